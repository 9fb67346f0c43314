"""The OpenAI-compatible HTTP frontend (`baton serve http`): a client of the public NATS API.

`api` is the wire format without sockets (parsing, answers, error mapping); `server` is the
aiohttp application and its lifetime."""
