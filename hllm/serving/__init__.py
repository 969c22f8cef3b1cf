"""Serving policy as plain Python, tested without Ray: the model catalog and the rollout's state machine
(`rollout`: shadow, canary, guards, promotion), the online cascade and its circuit breaker, with its threshold fitting
and offline evaluation (`cascade`). `serve/` runs them in Ray Serve replicas."""
