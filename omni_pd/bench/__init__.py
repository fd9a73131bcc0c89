"""`omni-pd bench serve`: a load benchmark of the OpenAI-compatible server.

Modules, one concern each:
  server  starts `omni-pd serve` on a free loopback port, waits for GET /health, stops it
  load    drives a server at a fixed concurrency (or open-loop rate), timing every request
  chat_sse  the chat client: streamed chat completions read as vLLM's bench clients read them
  stats   turns per-request timings into requests/s, tokens/s, percentiles and ratios
  report  the table on stdout, the JSON file and the PNG plot
  serve   the command itself: its arguments and the run over configs and concurrency levels
"""
