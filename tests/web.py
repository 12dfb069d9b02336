"""One HTTP client for the tests' plain calls to the servers and tools they start (`web.get`, `web.post`,
`web.stream`, as httpx's functions of those names). Each of httpx's module-level calls builds a client, and with
it a TLS context that loads the system's certificates: about 50 ms of CPU a call, for plain-HTTP requests, which
in polls and query loops added up to a minute of the suite's CPU. No connection is kept alive, so that every
request opens its own, as before: the servers come and go."""

import httpx

_client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))
get, post, stream = _client.get, _client.post, _client.stream
