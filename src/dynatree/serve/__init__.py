"""`dynatree serve`: an OpenAI-compatible HTTP server that decodes with tree speculation.

protocol.py (request bodies, error format) -> engine.py (models, queue, worker) -> app.py (routes);
../textstream.py turns committed tokens into text deltas with stop strings; metrics.py is /metrics;
command.py the CLI (serve, bench-serve).
"""
