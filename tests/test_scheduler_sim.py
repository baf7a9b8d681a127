"""The openb trace replay: Go's random stream, the replay order, each policy's scores, the metric, the CLI,
and the published best-fit means reproduced from the real traces (read in place from ../shared/data/openb)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pffs.cli.main import main as pffs_main
from pffs.scheduler.core.fragmentation import ANY_MODEL, NEXT_POD_WEIGHT, TypicalShapes
from pffs.scheduler.core.objects import Queue
from pffs.scheduler.core.session import run_session
from pffs.scheduler.replay import metrics
from pffs.scheduler.replay.as_session import ranked_names, session_group, session_nodes
from pffs.scheduler.replay.go_rand import GoRand
from pffs.scheduler.replay.mixes import make_mix
from pffs.scheduler.replay.model import MILLI, Cluster, Pod, PodList
from pffs.scheduler.replay.policies import (
    POLICIES,
    BestFitPolicy,
    CpuContestedPolicy,
    FgdPolicy,
    PffsPolicy,
    make_policy,
)
from pffs.scheduler.replay.simulate import replay
from pffs.scheduler.replay.traces import load_nodes, load_pods, replay_order

# Research-use data, read in place: beside the checkout (../shared), or where this workplace keeps it.
TRACES = next(
    (
        p
        for p in (Path(__file__).resolve().parents[2] / "shared/data/openb", Path("/work/shared/data/openb"))
        if p.is_dir()
    ),
    Path("/work/shared/data/openb"),
)
NODES_CSV = TRACES / "openb_node_list_gpu_node.csv"
needs_traces = pytest.mark.skipif(not NODES_CSV.exists(), reason=f"the openb traces are not at {TRACES}")


def cluster_of(*nodes: tuple[int, int, int, str]) -> Cluster:
    """Nodes as (cpu_milli, memory_mib, gpus, model)."""
    models = sorted({m for *_, m in nodes if m})
    return Cluster(
        [f"n{i}" for i in range(len(nodes))],
        np.array([n[0] for n in nodes], np.int64),
        np.array([n[1] for n in nodes], np.int64),
        np.array([n[2] for n in nodes], np.int64),
        np.array([models.index(n[3]) if n[2] else -1 for n in nodes], np.int64),
        models,
    )


def pods_of(*pods: tuple[int, int, int, int, str]) -> PodList:
    """Pods as (cpu_milli, memory_mib, share, count, gpu_spec)."""
    return PodList(
        [f"p{i}" for i in range(len(pods))],
        np.array([p[0] for p in pods], np.int64),
        np.array([p[1] for p in pods], np.int64),
        np.array([p[2] for p in pods], np.int64),
        np.array([p[3] for p in pods], np.int64),
        [p[4] for p in pods],
    )


def test_go_rand_matches_go_math_rand():
    # rand.New(rand.NewSource(1)).Int() in Go: the values Go printed for years under the old default seed.
    rng = GoRand(1)
    assert rng.go_int() == 5577006791947779410
    assert rng.go_int() == 8674665223082153551


def test_replay_order_shuffles_then_resamples_to_the_load():
    cluster = cluster_of((8000, 1000, 2, "A"), (8000, 1000, 2, "A"))  # 4000 milli
    trace = pods_of((1, 1, 1000, 1, ""), (1, 1, 500, 1, ""), (1, 1, 0, 0, ""), (1, 1, 1000, 2, ""))
    order = replay_order(trace, cluster, seed=7, ratio=1.3)
    head = order.pods[: len(trace)].tolist()
    assert sorted(head) == [0, 1, 2, 3]  # the whole trace, shuffled
    total = int(trace.gpu_milli[order.pods].sum())
    assert total <= 1.3 * 4000
    assert order.resampled == len(order.pods) - len(trace) > 0
    assert sorted(order.node_rank.tolist()) == [0, 1]
    again = replay_order(trace, cluster, seed=7, ratio=1.3)
    assert again.pods.tolist() == order.pods.tolist()  # a seed is a replay


def test_best_fit_scores_by_hand():
    cluster = cluster_of((64000, 10**6, 4, "A"), (128000, 10**6, 8, "A"))
    pod = Pod(32000, 1, MILLI, 2, ANY_MODEL)
    scores = BestFitPolicy().scores(cluster, pod, np.array([0, 1]))
    # node 0: 1 - (0.5*32/128 + 0.5*2000/8000) = 0.75; node 1: 1 - (0.5*96/128 + 0.5*6000/8000) = 0.25
    assert scores.tolist() == [75, 25]


def test_fgd_and_stranded_measures_by_hand():
    cluster = cluster_of((16000, 10**6, 4, "A"))
    typical = TypicalShapes.from_pods(pods_of((11000, 1, MILLI, 1, "")), cluster)
    cpu, gpus, bits = cluster.cpu_free, cluster.gpu_free, cluster.model_bits()
    assert typical.fragmentation(cpu, gpus, bits).tolist() == [0.0]  # one such pod still fits: no fragment
    assert typical.stranded(cpu, gpus, bits).tolist() == [3000.0]  # but it leaves 5 cores for 3 GPUs
    half = TypicalShapes.from_pods(pods_of((1000, 1, 500, 1, "")), cluster)
    gpus = np.array([[700, 1000, 200, 0]])
    # 500-milli pods: slots 1 + 2 + 0 + 0 = 3 use 1500 of 1900 free; FGD: 200 on the GPU below the share.
    assert half.stranded(cpu, gpus, bits).tolist() == [400.0]
    assert half.fragmentation(cpu, gpus, bits).tolist() == [200.0]
    # pffs's waste: what the filling strands plus NEXT_POD_WEIGHT times what the next pod cannot use.
    assert half.waste(cpu, gpus, bits).tolist() == pytest.approx([400.0 + NEXT_POD_WEIGHT * 200.0])


@needs_traces
def test_waste_is_stranded_plus_the_weighted_next_pod_fragment_on_the_openb_cluster():
    """The one-pass ``waste`` against its two parts computed apart, on random states of every openb node
    (GPU models, CPU-only shapes and shapes that cannot run anywhere included)."""
    cluster = load_nodes(NODES_CSV)
    pods = load_pods(TRACES / "openb_pod_list_default.csv")
    typical = TypicalShapes.from_pods(pods, cluster)
    weighted = typical.for_stranding()
    rng = np.random.default_rng(7)
    gpus = np.minimum(cluster.gpu_free, rng.integers(0, MILLI + 1, cluster.gpu_free.shape))
    cpu = rng.integers(-1000, 100_000, cluster.size)
    bits = cluster.model_bits()
    for shapes in (typical, weighted):
        expected = shapes.stranded(cpu, gpus, bits) + NEXT_POD_WEIGHT * shapes.fragmentation(cpu, gpus, bits)
        assert shapes.waste(cpu, gpus, bits) == pytest.approx(expected, rel=1e-12, abs=1e-9)
        assert shapes.next_pod(cpu, gpus, bits) == pytest.approx(
            shapes.fragmentation(cpu, gpus, bits), rel=1e-12, abs=1e-9
        )
    # The pffs policy measures with it, over FGD's shapes and the 8-GPU 120-core ones only the 39 nodes of
    # 128 cores can run (5 such pods in default: about a seventh of those nodes' GPUs).
    policy = make_policy("pffs", cluster, pods, GoRand(1))
    nodes = cluster.capacities()
    pffs_shapes = TypicalShapes.from_pods(pods, cluster, nodes=nodes)
    assert isinstance(policy, PffsPolicy)
    assert (
        policy._measure(cpu, gpus, bits).tolist()
        == pffs_shapes.for_stranding(nodes).waste(cpu, gpus, bits).tolist()
    )
    rare = (pffs_shapes.count == 8) & (pffs_shapes.cpu >= 120_000)
    assert (
        len(pffs_shapes) > len(typical)
        and rare.any()
        and not ((typical.count == 8) & (typical.cpu >= 120_000)).any()
    )
    assert set(pffs_shapes.hosts(nodes)[rare].tolist()) == {39}
    assert all(1.0 < s < cluster.size / 39 for s in pffs_shapes.scarcity(nodes)[rare].tolist())


def test_stranding_weights_divide_by_gpu_count_and_double_sharing_shapes():
    cluster = cluster_of((96000, 10**6, 8, "A"))
    trace = pods_of(
        *[(8000, 1, MILLI, 1, "")] * 4, (64000, 1, MILLI, 8, ""), (4000, 1, 500, 1, ""), (9000, 1, 0, 0, "")
    )
    typical = TypicalShapes.from_pods(trace, cluster, popularity=100)
    weighted = typical.for_stranding()
    by_shape = {
        (int(s), int(k)): p for s, k, p in zip(weighted.share, weighted.count, weighted.prob, strict=True)
    }
    total = 4 + 1 / 8 + 2 * 1 + 1  # one-GPU, 8-GPU / 8, sharing x 2, CPU-only
    assert by_shape == pytest.approx(
        {(MILLI, 1): 4 / total, (MILLI, 8): 0.125 / total, (500, 1): 2 / total, (0, 0): 1 / total}
    )
    # FGD's own shapes keep the pod frequencies; pffs's policy measures with the reweighted ones.
    assert typical.prob.tolist() == pytest.approx([4 / 7, 1 / 7, 1 / 7, 1 / 7])
    policy = make_policy("pffs", cluster, trace, GoRand(1))
    assert isinstance(policy, PffsPolicy) and policy.typical.prob.tolist() == weighted.prob.tolist()
    # A node with 7 free GPUs strands them all for the 8-GPU shape, but only at 1/8 of its pod frequency.
    gpus = np.array([[0] + [MILLI] * 7])
    alone = TypicalShapes.from_pods(pods_of((64000, 1, MILLI, 8, "")), cluster).for_stranding()
    assert alone.stranded(np.array([96000]), gpus, cluster.model_bits()).tolist() == [7000.0]


def test_pffs_keeps_rare_shapes_few_nodes_can_run_and_weighs_them_by_how_full_they_would_make_them():
    # Two of twenty 8-GPU nodes have 128 cores: only they run the 8-GPU pod with 120 cores.
    cluster = cluster_of(*[(96000, 10**6, 8, "A")] * 18, *[(128000, 10**6, 8, "A")] * 2)
    nodes = cluster.capacities()
    trace = pods_of(
        *[(8000, 1, MILLI, 1, "")] * 97,
        (120000, 1, MILLI, 8, ""),
        (4000, 1, 500, 1, ""),
        (4000, 1, MILLI, 1, "B"),
    )
    fgd = TypicalShapes.from_pods(trace, cluster)
    assert fgd.count.tolist() == [1] and fgd.pods == 100  # FGD's: 97 of 100 pods cover 95%
    # pffs's add the big pod's shape (2 hosts of 20), not the sharing one (any node) nor one naming a model.
    pffs = TypicalShapes.from_pods(trace, cluster, nodes=nodes)
    assert list(zip(pffs.cpu.tolist(), pffs.count.tolist(), strict=True)) == [(8000, 1), (120000, 8)]
    assert pffs.prob.tolist() == pytest.approx([97 / 98, 1 / 98])
    assert pffs.hosts(nodes).tolist() == [20, 2]
    # Its expected pods (1/98 of 100) ask for 8.16 of its hosts' 16 GPUs: half the 10-fold scarcity counts.
    pressure = (100 / 98) * 8 / 16
    assert pffs.scarcity(nodes).tolist() == pytest.approx([1.0, 1 + 9 * pressure])
    weights = pffs.for_stranding(nodes).prob
    assert weights[1] / weights[0] == pytest.approx((1 / 8) * (1 + 9 * pressure) / 97)
    # As many of them as their hosts hold, or more: the full ten-fold.
    crowded = pods_of(*[(8000, 1, MILLI, 1, "")] * 40, *[(120000, 1, MILLI, 8, "")] * 2)
    assert TypicalShapes.from_pods(crowded, cluster, nodes=nodes).scarcity(nodes).tolist() == [1.0, 10.0]
    # The same pods naming the GPU model: as few hosts, but the measure already sees which nodes they may use.
    named = pods_of(*[(8000, 1, MILLI, 1, "")] * 40, *[(120000, 1, MILLI, 8, "A")] * 2)
    shapes = TypicalShapes.from_pods(named, cluster, popularity=100, nodes=nodes)
    assert shapes.hosts(nodes).tolist() == [20, 2] and shapes.scarcity(nodes).tolist() == [1.0, 1.0]
    # Without the cluster's nodes (FGD, tests above), the weights are as before.
    assert pffs.for_stranding().prob[1] / pffs.for_stranding().prob[0] == pytest.approx((1 / 8) / 97)


def test_shapes_bound_to_a_gpu_model_weigh_against_that_models_gpus():
    # 18 nodes of model A and 2 of model B: B has 16 of the 160 GPUs, and 15 of the 100 pods need it.
    cluster = cluster_of(*[(96000, 10**6, 8, "A")] * 18, *[(96000, 10**6, 8, "B")] * 2)
    nodes = cluster.capacities()
    trace = pods_of(
        *[(8000, 1, MILLI, 1, "A")] * 45, *[(8000, 1, MILLI, 1, "")] * 40, *[(8000, 1, MILLI, 1, "B")] * 15
    )
    shapes = TypicalShapes.from_pods(trace, cluster, popularity=100, nodes=nodes)
    assert shapes.model_mask.tolist() == [1, ANY_MODEL, 2]
    assert shapes.scarcity(nodes).tolist() == pytest.approx([160 / 144, 1.0, 160 / 16])

    def drop(weighted: TypicalShapes, node: int) -> float:
        """How much the measure falls when a one-GPU pod that accepts any model lands on the empty node."""
        bits = nodes.model_bits[[node, node]]
        gpus = np.array([[MILLI] * 8, [0] + [MILLI] * 7])
        waste = weighted.waste(np.array([96000, 88000]), gpus, bits)
        return float(waste[0] - waste[1])

    # Weighed against their models' GPUs, B's pods ask more of B than A's of A: the pod goes to an A node.
    bound = shapes.for_stranding(nodes)
    assert drop(bound, 0) > drop(bound, 19)
    # Between them, the bound shapes keep the weight of their 60 pods in 100 (A 45 x 160/144 against B 15 x
    # 10, scaled back to 60): the any-model shape is not crowded out of the measure. All are then divided
    # by the part an average GPU's node accepts (``accessible_weight``, next test).
    accepted = 1 - (144 * 45 + 16 * 15) / 100 / 160  # A's nodes cannot use B's 45%, B's nodes A's 15%
    assert bound.prob.tolist() == pytest.approx([p / 100 / accepted for p in (15, 40, 45)])
    # By frequency alone, A's 45 pods outweigh B's 15 and the pod would take one of B's few GPUs.
    by_frequency = shapes.for_stranding()
    assert drop(by_frequency, 0) < drop(by_frequency, 19)


def test_the_shapes_a_node_accepts_weigh_one_on_the_average_gpus_node():
    # 18 nodes of model A, 2 of B; by frequency, 45 pods bound to A, 40 to any model, 15 to B.
    cluster = cluster_of(*[(96000, 10**6, 8, "A")] * 18, *[(96000, 10**6, 8, "B")] * 2)
    nodes = cluster.capacities()
    trace = pods_of(
        *[(8000, 1, MILLI, 1, "A")] * 45, *[(8000, 1, MILLI, 1, "")] * 40, *[(8000, 1, MILLI, 1, "B")] * 15
    )
    shapes = TypicalShapes.from_pods(trace, cluster, popularity=100, nodes=nodes)
    # A's nodes (144 of the 160 GPUs) cannot use B's 15%, B's nodes cannot use A's 45%.
    assert shapes.accessible_weight(nodes) == pytest.approx(1 - (144 * 0.15 + 16 * 0.45) / 160)
    weighted = shapes.for_stranding(nodes)
    accepted = shapes._accepts(nodes.model_bits) @ weighted.prob  # per node: the weight its GPUs can use
    assert float(accepted @ nodes.gpus) / float(nodes.gpus.sum()) == pytest.approx(1.0)
    # The pods that accept any model: nothing to divide by, the weights sum to 1 exactly as before.
    anywhere = pods_of(*[(8000, 1, MILLI, 1, "")] * 40, *[(4000, 1, 500, 1, "")] * 20)
    plain = TypicalShapes.from_pods(anywhere, cluster, popularity=100, nodes=nodes)
    assert plain.accessible_weight(nodes) == 1.0
    assert plain.for_stranding(nodes).prob.tolist() == plain.for_stranding().prob.tolist()


def test_sharing_pods_score_coarser_where_whole_gpu_shapes_weigh_and_finer_where_pods_are_bound():
    cluster = cluster_of((96000, 10**6, 8, "A"))
    mixed = pods_of(
        *[(8000, 1, MILLI, 1, "")] * 4, (64000, 1, MILLI, 8, ""), (4000, 1, 500, 1, ""), (9000, 1, 0, 0, "")
    )
    # Weights as in the test above: whole-GPU shapes 4 + 1/8, the sharing one 2, the CPU-only one not counted.
    weighted = TypicalShapes.from_pods(mixed, cluster, popularity=100).for_stranding()
    assert weighted.whole_gpu_fraction() == pytest.approx(4.125 / 6.125)
    policy = PffsPolicy(cluster, weighted)
    assert policy.sharing_temperature == 3 * PffsPolicy.TEMPERATURE  # 3.5 x 0.67 is past the cap of 1
    # One whole-GPU pod in ten (weights 1 against 9 x 2): 1 + 2 x 3.5 / 19 times the temperature.
    few_whole = pods_of((8000, 1, MILLI, 1, ""), *[(4000, 1, 500, 1, "")] * 9)
    few = TypicalShapes.from_pods(few_whole, cluster, popularity=100).for_stranding()
    assert PffsPolicy(cluster, few).sharing_temperature == pytest.approx(4000 * (1 + 2 * 3.5 / 19))
    # Half the GPU shapes' weight bound to model A: half as much coarser (whole-GPU part still past the cap),
    # and finer by 0.3 x the bound half: 2 x 0.85 times the temperature.
    two_models = cluster_of((96000, 10**6, 8, "A"), (96000, 10**6, 8, "B"))
    bound = pods_of(*[(8000, 1, MILLI, 1, "")] * 4, *[(8000, 1, MILLI, 1, "A")] * 4)
    half = TypicalShapes.from_pods(bound, two_models, popularity=100)
    assert half.unbound_fraction() == 0.5 and half.whole_gpu_fraction() == 1.0
    assert half.sharing_temperature == pytest.approx(2 * 0.85 * PffsPolicy.TEMPERATURE)
    # Every GPU pod bound to a model: no coarsening, and finer than the plain temperature (0.7 times).
    all_bound = pods_of(*[(8000, 1, MILLI, 1, "A")] * 4, *[(4000, 1, 500, 1, "B")] * 4)
    fine = TypicalShapes.from_pods(all_bound, two_models, popularity=100)
    assert fine.unbound_fraction() == 0.0
    assert fine.sharing_temperature == pytest.approx(0.7 * PffsPolicy.TEMPERATURE)
    # Sharing pods only: nothing coarser than before.
    sharing_only = TypicalShapes.from_pods(pods_of((4000, 1, 500, 1, ""), (9000, 1, 0, 0, "")), cluster)
    assert sharing_only.for_stranding().whole_gpu_fraction() == 0.0
    assert PffsPolicy(cluster, sharing_only.for_stranding()).sharing_temperature == PffsPolicy.TEMPERATURE
    # A drop of 200 milli against none: apart for a whole-GPU pod (51 / 50), tied for a sharing pod.
    before, after = np.array([1000.0, 1000.0]), np.array([800.0, 1000.0])
    whole_pod, sharing_pod = Pod(8000, 1, MILLI, 1, ANY_MODEL), Pod(4000, 1, 500, 1, ANY_MODEL)
    assert policy._score(whole_pod, before, after).tolist() == [51.0, 50.0]
    assert policy._score(sharing_pod, before, after).tolist() == [50.0, 50.0]


def test_pffs_sees_the_gpus_a_cpu_heavy_pod_would_strand_where_fgd_does_not():
    # The trace's GPU pods need 4 cores per GPU. A 40-core CPU-only pod on node 0 (48 cores, 4 GPUs) leaves
    # 8 cores: room for one such pod (FGD's test passes) but only two of the four GPUs can ever be used.
    cluster = cluster_of((48000, 10**6, 4, "A"), (128000, 10**6, 4, "A"))
    trace = pods_of(*[(4000, 1, MILLI, 1, "")] * 4, (40000, 1, 0, 0, ""))
    pod = trace.pod(4, cluster)
    typical = TypicalShapes.from_pods(trace, cluster)
    both = np.array([0, 1])
    fgd = FgdPolicy(cluster, typical).scores(cluster, pod, both)
    assert fgd[0] == fgd[1]
    pffs = PffsPolicy(cluster, typical).scores(cluster, pod, both)
    assert pffs[1] > pffs[0]
    # Stranded: 2 of 4 GPUs, weighted by the GPU shape's probability among the typical shapes (4 of 5 pods).
    one_node = (np.array([8000]), cluster.gpu_free[:1], cluster.model_bits()[:1])
    assert typical.stranded(*one_node).tolist() == [0.8 * 2000]


def test_where_cpu_only_pods_ask_for_half_the_cpu_gpu_pods_tie_to_the_node_with_least_cpu_per_gpu_left():
    # Two nodes of 2 GPUs: 64 cores and 16. The GPU pods need 4 cores per GPU.
    cluster = cluster_of((64000, 10**6, 2, "A"), (16000, 10**6, 2, "A"))
    nodes = cluster.capacities()
    light = pods_of(*[(4000, 1, MILLI, 1, "")] * 4, (12000, 1, 0, 0, ""))
    # CPU-only cores per GPU asked for (12000 x 1/5 over 4/5 GPU), times the cluster's 4 GPUs over 80 cores
    assert TypicalShapes.from_pods(light, cluster, nodes=nodes).cpu_only_demand(nodes) == pytest.approx(0.15)
    assert isinstance(make_policy("pffs", cluster, light, GoRand(1)), PffsPolicy)
    crowded = pods_of(*[(4000, 1, MILLI, 1, "")] * 4, *[(12000, 1, 0, 0, "")] * 4)
    assert TypicalShapes.from_pods(crowded, cluster, nodes=nodes).cpu_only_demand(nodes) == pytest.approx(0.6)
    policy = make_policy("pffs", cluster, crowded, GoRand(1))
    assert isinstance(policy, CpuContestedPolicy)
    gpu_pod, cpu_pod, both = (
        Pod(4000, 1, MILLI, 1, ANY_MODEL),
        Pod(12000, 1, 0, 0, ANY_MODEL),
        np.array([0, 1]),
    )
    # Either node keeps room for the other GPU: the measure ties them, and pffs's own policy too.
    assert len(set(policy.cpu_pods.scores(cluster, gpu_pod, both).tolist())) == 1
    contested = policy.scores(cluster, gpu_pod, both)
    # The contested policy breaks the tie (by under a point) for the node left with 12 cores for its free
    # GPU, not 60: the 64-core node's CPU is the one CPU-only pods can take without stranding a GPU.
    assert np.floor(contested[0]) == np.floor(contested[1]) and contested[1] > contested[0]
    # CPU-only pods are placed by pffs's own scores: the 16-core node would strand a GPU (4 cores left).
    cpu_scores = policy.scores(cluster, cpu_pod, both)
    assert cpu_scores.tolist() == policy.cpu_pods.scores(cluster, cpu_pod, both).tolist()
    assert cpu_scores[0] > cpu_scores[1]
    # Its GPU pods are scored on FGD's next-pod fragment, at FGD's temperature.
    state = (cluster.cpu_free, cluster.gpu_free, cluster.model_bits())
    assert policy.gpu_pods._measure(*state).tolist() == policy.gpu_pods.typical.next_pod(*state).tolist()


@needs_traces
@pytest.mark.parametrize("trace", ["default", "nongpu40", "gpuspec85"])
def test_the_gang_session_places_every_pod_where_the_trace_policy_does(trace):
    """`pffs scheduler`'s session scores with the trace policy's measure and whole points, a sharing pod on
    every GPU it fits and on the best of them, and switches as the trace policy does where CPU-only pods ask
    for much of the CPU (mix nongpu40): given the same pods, shapes and node order, each pod goes to the
    same node and a sharing pod to a GPU with as much free (one that differed would change later states).
    gpuspec85 binds most of its pods to GPU models, so its sharing pods score at the finer temperature."""
    cluster = load_nodes(NODES_CSV)
    base = load_pods(TRACES / "openb_pod_list_default.csv")
    pods = base if trace == "default" else make_mix(trace, base, cluster)
    order = replay_order(pods, cluster, 42)
    kept = order.pods.tolist()[:3000]
    assert sum(0 < pods.share[i] < MILLI for i in kept) > 500  # sharing pods among them
    prefix = pods.take(np.array(kept))
    state, rank = cluster.copy(), order.node_rank
    policy = make_policy("pffs", state, prefix, GoRand(1))  # the session counts shapes over its own pods
    assert isinstance(policy, CpuContestedPolicy if trace == "nongpu40" else PffsPolicy)
    replayed = {}
    for i in range(len(kept)):
        pod = prefix.pod(i, state)
        nodes = np.flatnonzero(state.feasible(pod, state.model_bits()))
        if not len(nodes):  # no node could ever take it (too big for any): the session leaves it pending
            continue
        scores = policy.scores(state, pod, nodes)
        best = nodes[scores == scores.max()]
        node = int(best[rank[best].argmin()])
        state.place(node, pod, policy.choose_gpus(state, pod, node))
        policy.node_changed(state, node)
        replayed[f"g{i:05}"] = node
    names = ranked_names(rank)
    groups = [session_group(prefix, i, f"g{i:05}", float(i)) for i in range(len(kept))]
    session = run_session(session_nodes(cluster, names), [Queue("default")], groups, [])
    placed = {p.pod.group: names.index(p.node) for p in session.placements}
    assert len(replayed) > 0.99 * len(kept)
    assert placed == replayed
    # Sharing pods on GPUs with as much free as the replay's: every node ends with the same free milli per
    # GPU (sorted: whole-GPU pods may take other free slots of a node, by its NVLink groups).
    session_free = np.where(np.arange(state.gpu_free.shape[1]) < cluster.gpu_count[:, None], MILLI, 0)
    for p in session.placements:
        for g in p.gpus:
            session_free[names.index(p.node), g] -= p.pod.gpu_milli
    assert (np.sort(session_free, axis=1) == np.sort(state.gpu_free, axis=1)).all()


def test_alloc_at_averages_the_events_that_round_to_the_level():
    capacity = 10 * MILLI  # 10 GPUs: 1% = 100 milli
    arrived = np.array([9900, 9960, 10040, 10060, 12000])  # 99%, 100% (99.6), 100% (100.4), 101%, 120%
    used = np.array([9000, 9100, 9300, 9300, 9500])
    assert metrics.alloc_at(arrived, used, capacity, 100) == pytest.approx((91 + 93) / 2)
    assert metrics.alloc_at(arrived, used, capacity, 120) == 95.0
    # No event at 110%: the events within one point of it; none there either.
    assert metrics.alloc_at(arrived, used, capacity, 110) is None


node_strategy = st.tuples(
    st.sampled_from([8000, 16000, 64000]),
    st.sampled_from([16384, 65536]),
    st.integers(0, 8),
    st.sampled_from(["A", "B"]),
)
pod_strategy = st.one_of(
    st.tuples(
        st.sampled_from([1000, 4000, 12000]),
        st.sampled_from([1024, 8192]),
        st.just(0),
        st.just(0),
        st.just(""),
    ),
    st.tuples(
        st.sampled_from([1000, 4000]),
        st.just(1024),
        st.sampled_from([100, 250, 500, 700]),
        st.just(1),
        st.sampled_from(["", "A", "B"]),
    ),
    st.tuples(
        st.just(2000), st.just(2048), st.just(MILLI), st.integers(1, 8), st.sampled_from(["", "A|B", "B"])
    ),
)


@settings(max_examples=40, deadline=None)
@given(
    nodes=st.lists(node_strategy, min_size=1, max_size=6),
    pods=st.lists(pod_strategy, min_size=1, max_size=30),
    policy=st.sampled_from(sorted(POLICIES)),
    seed=st.integers(0, 1000),
)
def test_replay_never_over_allocates(nodes, pods, policy, seed):
    cluster = cluster_of(*nodes)
    trace = pods_of(*pods)
    order = replay_order(trace, cluster, seed, ratio=0)  # the trace as it is, shuffled
    chosen = make_policy(policy, cluster, trace, order.rng)
    bits = cluster.model_bits()
    for index in order.pods.tolist():
        pod = trace.pod(index, cluster)
        before = cluster.gpu_free.copy(), cluster.cpu_free.copy()
        feasible = np.flatnonzero(cluster.feasible(pod, bits))
        if not len(feasible):
            continue
        scores = chosen.scores(cluster, pod, feasible)
        node = int(feasible[int(np.argmax(scores))])
        gpus = chosen.choose_gpus(cluster, pod, node)
        assert len(set(gpus)) == pod.count
        if pod.count > 1 or pod.share == MILLI:
            assert all(before[0][node][g] == MILLI for g in gpus)  # whole GPUs are fully free ones
        if pod.model_mask != ANY_MODEL:
            assert pod.model_mask & (1 << int(cluster.gpu_model[node]))
        cluster.place(node, pod, gpus)
        chosen.node_changed(cluster, node)
        changed = np.flatnonzero(
            (cluster.gpu_free != before[0]).any(axis=1) | (cluster.cpu_free != before[1])
        )
        assert set(changed.tolist()) <= {node}
    assert (cluster.cpu_free >= 0).all() and (cluster.mem_free >= 0).all()
    assert (cluster.gpu_free >= 0).all() and (cluster.gpu_free <= MILLI).all()
    width = cluster.gpu_free.shape[1]
    missing = np.arange(width)[None, :] >= cluster.gpu_count[:, None]
    assert (cluster.gpu_free[missing] == 0).all()  # nothing placed on a GPU a node does not have


def test_replay_can_stop_where_the_arrived_demand_reaches_a_mark():
    """``stop_at``: the same replay cut before the first pod that would take the arrived demand past the
    mark, with the cluster as it stood there (bench/scheduler_headroom.py looks at it at 100%)."""
    cluster = cluster_of((64000, 262144, 4, "V100"), (32000, 131072, 2, "T4"))
    trace = pods_of(
        (4000, 1024, 500, 1, ""),
        (2000, 2048, MILLI, 2, ""),
        (1000, 1024, 250, 1, "T4"),
        (8000, 1024, 0, 0, ""),
    )
    whole = replay(cluster, trace, "pffs", 7)
    cut = replay(cluster, trace, "pffs", 7, stop_at=0.5)
    mark = 0.5 * cluster.gpu_capacity_milli
    assert 0 < cut.pods < whole.pods
    assert cut.arrived[-1] <= mark < whole.arrived[cut.pods]  # the next pod would have passed the mark
    assert cut.used.tolist() == whole.used[: cut.pods].tolist()
    assert cut.cluster is not None and cut.cluster.used_gpu_milli == cut.used[-1]
    assert cluster.used_gpu_milli == 0  # the replay placed pods on a copy


@needs_traces
@pytest.mark.parametrize(
    ("trace", "published"), [("default", (92.86, 93.08)), ("gpushare100", (84.62, 85.01))]
)
def test_best_fit_reproduces_the_published_means(trace, published):
    """Weng et al. (ATC '23) publish best-fit's mean over seeds 42-51; the replay must give the same."""
    cluster = load_nodes(NODES_CSV)
    pods = load_pods(TRACES / f"openb_pod_list_{trace}.csv")
    results = [replay(cluster, pods, "best-fit", seed) for seed in range(42, 52)]
    at100 = statistics.mean(r.alloc_at(100) for r in results)
    at130 = statistics.mean(r.alloc_at(130) for r in results)
    assert (round(at100, 2), round(at130, 2)) == published


def test_cli_simulate_table_and_json(tmp_path, capsys):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,4,V100\nn1,32000,131072,2,T4\n")
    pods = tmp_path / "pods.csv"
    pods.write_text(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec\n"
        "p0,4000,8192,1,500,\np1,8000,8192,2,1000,V100\np2,2000,1024,0,0,\np3,4000,4096,1,1000,T4\n"
    )
    argv = ["sched", "simulate", "--nodes", str(nodes), "--pods", str(pods), "--policy", "pffs"]
    assert pffs_main([*argv, "--json", "--seed", "1", "--seed", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["seed"] for s in out["seeds"]] == [1, 2]
    assert out["gpus"] == 6
    for s in out["seeds"]:
        assert s["placed"] + s["failed"] == s["pods"] >= 4
    assert pffs_main(argv) == 0
    table = capsys.readouterr().out
    assert "alloc@100%" in table and "pffs on 2 nodes (6 GPUs)" in table


def test_cli_simulate_errors(tmp_path, capsys):
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,4,V100\n")
    with pytest.raises(SystemExit) as exc:
        pffs_main(["sched", "simulate", "--nodes", str(nodes), "--pods", str(nodes), "--policy", "nope"])
    assert exc.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert pffs_main(["sched", "simulate", "--nodes", str(tmp_path / "gone.csv"), "--pods", str(nodes)]) == 1
    assert "gone.csv: No such file or directory" in capsys.readouterr().err
    # A node list where a pod list belongs: one line naming the missing columns, usage error.
    assert pffs_main(["sched", "simulate", "--nodes", str(nodes), "--pods", str(nodes)]) == 2
    err = capsys.readouterr().err
    assert "missing column(s) name, num_gpu, gpu_milli" in err and err.count("\n") == 1


def _share_of_demand(pods: PodList, which: np.ndarray) -> float:
    return float(pods.gpu_milli[which].sum() / pods.gpu_milli.sum())


def test_mixes_turn_one_dial_each():
    cluster = cluster_of((96000, 10**6, 8, "A"), (32000, 10**6, 2, "B"))
    base = pods_of(
        *[(8000, 1, MILLI, 1, "")] * 40,
        *[(4000, 1, 500, 1, "")] * 30,
        *[(16000, 1, MILLI, 2, "")] * 3,
        *[(12000, 1, 0, 0, "")] * 10,
    )
    multi = make_mix("multigpu40", base, cluster)
    assert multi.cpu[: len(base)].tolist() == base.cpu.tolist()  # the base, then multi-GPU pods appended
    assert (multi.count[len(base) :] == 2).all()
    assert 0.40 <= _share_of_demand(multi, multi.count > 1) < 0.45
    share = make_mix("gpushare70", base, cluster)
    assert len(share) == len(base) and (share.count == 0).sum() == 10
    assert _share_of_demand(share, share.share < MILLI) == pytest.approx(0.70, abs=0.04)
    spec = make_mix("gpuspec50", base, cluster)
    constrained = [i for i, s in enumerate(spec.specs) if s]
    assert 0.3 < len(constrained) / int((base.count > 0).sum()) < 0.7
    # A constrained pod names a model with a node that can host it (2-GPU pods fit both; 8-core ones fit both)
    assert all(spec.specs[i] in ("A", "B") for i in constrained)
    assert all(spec.specs[i] == "" for i in np.flatnonzero(base.count == 0).tolist())
    cpu = make_mix("nongpu30", base, cluster)
    assert (cpu.count > 0).sum() == (base.count > 0).sum()
    assert (cpu.count == 0).mean() == pytest.approx(0.30, abs=0.02)
    assert make_mix("gpushare70", base, cluster).cpu.tolist() == share.cpu.tolist()  # a name is one mix
    assert sorted(share.names) == share.names and len(set(share.names)) == len(share)
    for bad in ("multigpu", "gpushare101", "nongpu100", "default"):
        with pytest.raises(ValueError, match="mix"):
            make_mix(bad, base, cluster)


@needs_traces
def test_held_out_mixes_from_the_default_trace():
    cluster = load_nodes(NODES_CSV)
    base = load_pods(TRACES / "openb_pod_list_default.csv")
    multi = make_mix("multigpu40", base, cluster)
    assert _share_of_demand(multi, multi.count > 1) == pytest.approx(0.40, abs=0.005)
    spec = make_mix("gpuspec33", base, cluster)
    for i in [i for i, s in enumerate(spec.specs) if s][:200]:
        pod = spec.pod(i, cluster)  # every constrained pod has a node of its model that can host it
        hosts = (cluster.model_bits() & pod.model_mask != 0) & (cluster.gpu_count >= pod.count)
        assert (hosts & (cluster.cpu_capacity >= pod.cpu)).any()
