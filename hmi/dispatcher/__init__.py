"""The HTTP layer over ``hmi.services``: the aiohttp app, routes per feature with their request
models (``schemas``), validation, the bearer token, the OpenAPI document, the console, the
HAProxy gate in front, and starting a serving process (``serve``, ``launch``)."""
