"""pffs.scheduler: GPU/gang scheduling with cache locality, in three floors; imports go one way, down to core.

- ``core/``: the pure scheduling core (no Kubernetes, no I/O): the objects, one session's state, the scoring
  plugins, the session (enqueue, gang allocate, backfill, preempt and reclaim), and the GPU fragmentation
  measure it shares with the replay.
- ``replay/``: the trace replay (openb traces, the reference simulator's policies and metric) and the
  synthetic gang and locality simulations; they drive the core, never Kubernetes.
- ``kube/``: the Kubernetes edge: the REST client, the translation of Kubernetes objects into the core's,
  the loop of `pffs scheduler`, `pffs extender`, the queues file, Prometheus metrics, and the cache report
  the CSI plugin publishes (``kube/locality.py``).
"""
