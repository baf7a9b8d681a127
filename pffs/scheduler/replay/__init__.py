"""The trace replay and the simulations; they use the core, never Kubernetes. ``model.py`` (nodes and pods
as NumPy arrays), ``go_rand.py`` (Go's math/rand, for the reference's random stream), ``traces.py`` (the
openb CSV traces and the reference's pod order), ``policies.py`` (the reference's placement policies and
pffs's), ``simulate.py`` (one replay), ``metrics.py`` (the trace metric: allocation at arrived demand),
``synthetic.py`` (gang and locality simulations that drive the core's session)."""

# The policies' names, for the command line's choices without importing NumPy (policies.py checks that
# its table names the same).
POLICY_NAMES = ("random", "dot-product", "gpu-packing", "best-fit", "fgd", "pffs")
