"""The ``pdserve`` command: the command line, the local launcher (``pdserve up``)
and the embedded Redis. The roof of the house: it imports the router and the
node packages below it; nothing imports it."""
