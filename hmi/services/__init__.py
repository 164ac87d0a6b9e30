"""The service layer of a serving process: tenants and what is served, domains, jobs and their
workers, the registry, authentication, adapter transfer, usage, metrics and the hGPT runtime's
holder, wired together by ``server.Server``.  Services know nothing of HTTP: they raise
``hmi.errors.Refusal``, which the HTTP layer (``hmi.dispatcher``) alone maps to status codes."""
