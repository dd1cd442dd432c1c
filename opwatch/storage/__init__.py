"""Saved runs: :mod:`.codec` (facts to JSON and back), :mod:`.jsonl` (the JSON Lines log:
write and ``opwatch.load``) and :mod:`.chrome_trace` (the trace for Perfetto and chrome://tracing)."""
