"""The two servers: ``mmferry launch render`` (:mod:`mmferry.server.render`) and
``mmferry serve`` (:mod:`mmferry.server.encode`), with what they share: the frames body,
error answers, media fetching under a policy, the render process pool and metrics.
Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client, httpx, python-multipart)."""
