"""docs/flags.md is what the parsers say now (pdserve/flags_doc.py writes it)."""

from __future__ import annotations

from pdserve import flags_doc


def test_the_flags_page_is_current():
    assert flags_doc.PAGE.read_text() == flags_doc.render(), (
        "docs/flags.md is stale: run python -m pdserve.flags_doc"
    )


def test_the_page_shows_built_in_defaults_whatever_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_LEASE_S", "7")
    monkeypatch.setenv("PDCTL_ADDRESS", "10.0.0.1:1")
    page = flags_doc.render()
    assert "| `--kv-lease` | `PDSERVE_KV_LEASE_S` | `30.0` |" in page
    assert "`127.0.0.1:50052`" in page and "10.0.0.1:1" not in page


def test_every_command_is_on_the_page():
    page = flags_doc.render()
    for title in ("pdserve up", "pdserve router", "pdserve prefill", "pdserve decode"):
        assert f"`{title}`" in page
    for command in ("generate", "bench serve", "bench plot", "model prepare", "demo"):
        assert f"## `pdserve {command}`" in page
    for command in ("nodes", "drain", "undrain", "stats", "explain", "flush", "top"):
        assert f"### `pdctl {command}`" in page
    assert "--migration-wait" in page and "--kv-connect-timeout" in page
