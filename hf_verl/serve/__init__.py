"""The rollout server (`hf-verl serve`): FastAPI routes (`app`), request models (`schema`), answers (`responses`),
errors (`errors`), access rules (`auth`), token-level streaming (`streaming`), request batching (`batching`) and
versioned weight updates (`weights`), put together by :class:`~hf_verl.serve.server.RolloutServer`."""
