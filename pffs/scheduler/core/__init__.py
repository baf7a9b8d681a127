"""The pure scheduling core: a function of a snapshot, no Kubernetes, no I/O. From the bottom up:
``objects.py`` (nodes, GPUs, pods, pod groups, queues, placements), ``arrays.py`` (the NumPy array types),
``fragmentation.py`` (FGD's typical shapes and a node's fragment, shared with the replay), ``state.py``
(what is free on each node during a session), ``scoring.py`` (the node scores), ``session.py``
(``run_session``: enqueue, gang allocate, backfill, preempt and reclaim)."""
