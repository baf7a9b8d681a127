"""pffs.scheduler: GPU/gang scheduling with cache locality. The core is a pure model (no Kubernetes client);
the extender and the scheduler loop are thin adapters at its edge."""
