"""`pdserve bench serve` / `pdserve bench plot`: an open-loop serving benchmark.

It lives in the installed `pdserve` package (not benchmarks/, which is not
installed) so `pdserve bench` works wherever `pdserve` is installed. Modules:
datasets (what to send), backends (OpenAI HTTP, pdserve gRPC), loadgen (when to
send it), metrics (what came back), report (table, JSON record), plot, cli.
"""
