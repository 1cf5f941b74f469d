"""Operator tools, apart from the four services: the `specserve` command (`cli.py`), the
local cluster and its supervisor, `doctor`, `plan`, `rollout` and the streaming client."""
