"""dsc.serve: the OpenAI-compatible HTTP server (`dsc serve`) and its load generator
(`dsc bench-serve`). Needs the `serve` extra (fastapi, uvicorn, prometheus-client, openai,
pyzmq, msgpack).

    app.py             the FastAPI app: endpoints, OpenAI error bodies, streaming
    protocol.py        request and response bodies (pydantic)
    client.py          the API process's driver of the engine process: tokenize, detokenize, stop strings
    engine_process.py  the engine process: LLMEngine's loop behind two ZeroMQ sockets
    driver.py          an in-process engine thread and its inbox
    metrics.py         Prometheus metrics
    server.py          uvicorn, signals, graceful shutdown
    bench.py     the load generator (Poisson arrivals, TTFT / ITL / E2E percentiles)
"""
