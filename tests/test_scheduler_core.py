"""The scheduling core's session: hypothesis properties over random clusters, and unit tests of each rule."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pffs.scheduler.core import scoring
from pffs.scheduler.core.fragmentation import ANY_MODEL, NodeCapacities, TypicalShapes
from pffs.scheduler.core.objects import MILLI, Gpu, Node, Placement, Pod, PodGroup, Queue, Resources
from pffs.scheduler.core.session import SessionResult, Weights, run_session
from pffs.scheduler.replay.synthetic import Job, make_cluster, simulate

# --- builders ----------------------------------------------------------------------------------------


def gpu_node(
    name: str,
    gpus: int = 8,
    tor: str = "t0",
    cpu: int = 64_000,
    mem: int = 512_000,
    nvlink: int = 4,
    numa: int = 4,
    cached: dict[str, float] | None = None,
    labels: dict[str, str] | None = None,
    model: str = "A100",
) -> Node:
    return Node(
        name,
        cpu,
        mem,
        tuple(Gpu(i, i // nvlink, i // numa) for i in range(gpus)),
        model,
        tor,
        labels=labels or {},
        cached=cached or {},
    )


def gang(
    name: str,
    pods: int,
    gpus: int = 8,
    milli: int = MILLI,
    queue: str = "q",
    min_member: int | None = None,
    priority: int = 0,
    created: float = 0.0,
    datasets: tuple[str, ...] = (),
    cpu: int = 1000,
    mem: int = 1000,
    selector: dict[str, str] | None = None,
    models: frozenset[str] = frozenset(),
) -> PodGroup:
    return PodGroup(
        name,
        queue,
        [
            Pod(
                f"{name}-{k}",
                name,
                cpu,
                mem,
                gpus,
                milli,
                datasets=datasets,
                node_selector=selector or {},
                gpu_models=models,
            )
            for k in range(pods)
        ],
        min_member=pods if min_member is None else min_member,
        priority=priority,
        created=created,
    )


def running_on(group: PodGroup, nodes: Sequence[str], gpus: Sequence[tuple[int, ...]]) -> list[Placement]:
    return [Placement(p, n, g) for p, n, g in zip(group.pods, nodes, gpus, strict=True)]


def placed(result: SessionResult, group: str) -> list[Placement]:
    return [p for p in result.placements if p.pod.group == group]


def usage(placements: Sequence[Placement], groups: Sequence[PodGroup]) -> dict[str, Resources]:
    queue_of = {g.name: g.queue for g in groups}
    out: dict[str, Resources] = defaultdict(Resources)
    for p in placements:
        out[queue_of[p.pod.group]] = out[queue_of[p.pod.group]] + p.pod.request
    return out


def after(running: Sequence[Placement], result: SessionResult) -> list[Placement]:
    gone = {(p.pod.group, p.pod.name) for p in result.evictions}
    return [p for p in running if (p.pod.group, p.pod.name) not in gone] + result.placements


def over_allocated(nodes: Sequence[Node], placements: Sequence[Placement]) -> list[str]:
    """What the placements over-allocate (empty if nothing)."""
    by_name = {n.name: n for n in nodes}
    cpu: Counter[str] = Counter()
    mem: Counter[str] = Counter()
    gpu: Counter[tuple[str, int]] = Counter()
    for p in placements:
        cpu[p.node] += p.pod.cpu_milli
        mem[p.node] += p.pod.memory_mib
        for g in p.gpus:
            gpu[(p.node, g)] += p.pod.gpu_milli
    bad = [f"cpu {n}" for n, v in cpu.items() if v > by_name[n].cpu_milli]
    bad += [f"mem {n}" for n, v in mem.items() if v > by_name[n].memory_mib]
    bad += [f"gpu {k}" for k, v in gpu.items() if v > MILLI]
    return bad


# --- random clusters -----------------------------------------------------------------------------------

MODELS = ("A100", "V100")


@st.composite
def scenarios(
    draw: st.DrawFn, contended: bool = False
) -> tuple[list[Node], list[Queue], list[PodGroup], list[Placement]]:
    """A random cluster, queues and groups, and a running set that a first session placed for some of
    the groups. ``contended``: few nodes, one GPU model, no selectors, and new groups of higher priority
    than running ones, so that preemption and reclaim have work."""
    models = MODELS[:1] if contended else MODELS
    n_nodes = draw(st.integers(1, 2 if contended else 5))
    nodes = []
    for i in range(n_nodes):
        gpus = draw(st.sampled_from([2, 4, 8] if contended else [0, 1, 2, 4, 8]))
        nodes.append(
            gpu_node(
                f"n{i}",
                gpus=gpus,
                tor=f"t{draw(st.integers(0, 1))}",
                cpu=draw(st.integers(2, 16)) * 1000,
                mem=draw(st.integers(2, 16)) * 1000,
                nvlink=draw(st.sampled_from([2, 4])),
                labels={"zone": draw(st.sampled_from("ab"))},
                model=draw(st.sampled_from(models)),
                cached={"s3://d/x": draw(st.sampled_from([0.0, 0.5, 1.0]))},
            )
        )
    queues = []
    for j in range(draw(st.integers(1, 3))):
        cap_gpu = draw(st.sampled_from([2000, 4000, 8000, 2**40]))
        queues.append(
            Queue(
                f"q{j}",
                weight=draw(st.integers(1, 3)),
                guaranteed=Resources(0, 0, draw(st.sampled_from([0, 1000, 4000]))),
                capability=Resources(2**40, 2**40, cap_gpu),
                overcommit=draw(st.booleans()),
                reclaimable=draw(st.booleans()),
            )
        )
    groups, old = [], []
    for k in range(draw(st.integers(1, 7))):
        is_old = draw(st.booleans())  # running groups lean to low priority, so that preemption has work
        n_pods = draw(st.integers(1, 4))
        pods = []
        for m in range(n_pods):
            kind = draw(st.sampled_from(["cpu", "share", "whole"]))
            count, milli = {
                "cpu": (0, 0),
                "share": (1, draw(st.sampled_from([250, 500, 700]))),
                "whole": (0, 0),
            }[kind]
            if kind == "whole":
                count, milli = draw(st.integers(1, 4)), MILLI
            pods.append(
                Pod(
                    f"g{k}-{m}",
                    f"g{k}",
                    draw(st.integers(0, 4)) * 500,
                    draw(st.integers(0, 4)) * 500,
                    count,
                    milli,
                    gpu_models=frozenset(draw(st.sets(st.sampled_from(models), max_size=1))),
                    node_selector={} if contended else draw(st.sampled_from([{}, {}, {"zone": "a"}])),
                    datasets=draw(st.sampled_from([(), ("s3://d/x",)])),
                )
            )
        groups.append(
            PodGroup(
                f"g{k}",
                draw(st.sampled_from([q.name for q in queues] + ([] if contended else ["nowhere"]))),
                pods,
                min_member=draw(st.integers(1, n_pods)),
                priority=draw(st.integers(0, 1) if is_old else st.integers(2 if contended else 0, 3)),
                created=float(draw(st.integers(0, 5))),
            )
        )
        if is_old:
            old.append(groups[-1])
    # the running set: what a first session placed for the old groups
    running = run_session(nodes, queues, old, []).placements
    return nodes, queues, groups, running


PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WEIGHTS = st.sampled_from(
    [Weights(), Weights(0, 0, 0, 0, 0), Weights(locality=5.0, tor=3.0), Weights(2, 0, 1, 0, 1)]
)


@PROPERTY
@given(st.one_of(scenarios(), scenarios(contended=True)), WEIGHTS)
def test_never_over_allocates_and_respects_hard_constraints(scenario, weights: Weights) -> None:
    nodes, queues, groups, running = scenario
    result = run_session(nodes, queues, groups, running, weights)
    assert over_allocated(nodes, after(running, result)) == []
    by_name = {n.name: n for n in nodes}
    for p in result.placements:
        node = by_name[p.node]
        assert node.schedulable
        assert all(node.labels.get(k) == v for k, v in p.pod.node_selector.items())
        if p.pod.gpu_count and p.pod.gpu_milli:
            assert len(set(p.gpus)) == p.pod.gpu_count
            assert set(p.gpus) <= {g.index for g in node.gpus}
            assert not p.pod.gpu_models or node.gpu_model in p.pod.gpu_models
        else:
            assert p.gpus == ()


@PROPERTY
@given(st.one_of(scenarios(), scenarios(contended=True)))
def test_cached_fragmentation_scores_decide_as_fresh_ones(scenario) -> None:
    """The fragmentation score is cached per pod shape and refreshed per changed node (rollbacks included):
    a session must decide exactly as one that recomputes every score."""
    nodes, queues, groups, running = scenario
    cached = run_session(nodes, queues, groups, running)
    original = scoring.waste_growth

    def fresh(state, shapes, pod):
        state.score_cache.clear()
        return original(state, shapes, pod)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(scoring, "waste_growth", fresh)
        recomputed = run_session(nodes, queues, groups, running)
    assert cached == recomputed


@PROPERTY
@given(st.one_of(scenarios(), scenarios(contended=True)), WEIGHTS)
def test_gangs_all_or_nothing_and_quotas(scenario, weights: Weights) -> None:
    nodes, queues, groups, running = scenario
    result = run_session(nodes, queues, groups, running, weights)
    final = after(running, result)
    count = Counter(p.pod.group for p in final)
    by_group = {g.name: g for g in groups}
    for name in {p.pod.group for p in result.placements}:
        assert count[name] >= by_group[name].min_member, name
        assert by_group[name].queue in {q.name for q in queues}
    # a pod is placed at most once, and never one that is running
    keys = [(p.pod.group, p.pod.name) for p in final]
    assert len(keys) == len(set(keys))
    # non-overcommit queues stay within capability (the running set came from a session, so started within)
    used = usage(final, groups)
    for q in queues:
        if not q.overcommit:
            assert used[q.name].fits_within(q.capability), q
    # every group that waits has a reason; unknown queues say so
    for g in groups:
        if g.queue == "nowhere":
            assert "unknown" in result.pending.get(g.name, "unknown")
            assert not placed(result, g.name)
        if count[g.name] < g.min_member:
            assert g.name in result.pending


@PROPERTY
@given(st.one_of(scenarios(), scenarios(contended=True)), WEIGHTS)
def test_evictions_are_whole_groups_and_each_is_needed(scenario, weights: Weights) -> None:
    nodes, queues, groups, running = scenario
    result = run_session(nodes, queues, groups, running, weights)
    evicted = {p.pod.group for p in result.evictions}
    for name in evicted:  # whole groups
        assert {p.pod.name for p in running if p.pod.group == name} == {
            p.pod.name for p in result.evictions if p.pod.group == name
        }
        assert not placed(result, name)
    if evicted:
        assert result.placements
    # each evicted group is needed: putting it back beside the session's outcome over-allocates a node or a
    # GPU, or takes its non-overcommit queue past capability
    final = after(running, result)
    queue = {q.name: q for q in queues}
    by_group = {g.name: g for g in groups}
    for name in evicted:
        back = final + [p for p in running if p.pod.group == name]
        q = queue[by_group[name].queue]
        quota_broken = not q.overcommit and not usage(back, groups)[q.name].fits_within(q.capability)
        assert over_allocated(nodes, back) or quota_broken, name


# --- unit tests ------------------------------------------------------------------------------------


def test_overcommit_queue_admits_past_capability_and_marks_the_group() -> None:
    nodes = [gpu_node("n0")]
    cap = Resources(2**40, 2**40, 2000)
    queues = [Queue("over", capability=cap, overcommit=True), Queue("strict", capability=cap)]
    groups = [gang("a", 1, gpus=4, queue="over"), gang("b", 1, gpus=4, queue="strict")]
    result = run_session(nodes, queues, groups, [])
    assert result.overcommitted == ["a"]
    assert placed(result, "a") and not placed(result, "b")
    assert result.pending["b"].startswith("quota") and "gpu_milli" in result.pending["b"]


def test_gang_all_or_nothing_waits_without_holding() -> None:
    nodes = [gpu_node("n0"), gpu_node("n1")]
    groups = [gang("big", 3, gpus=8), gang("small", 1, gpus=2, created=1)]
    result = run_session(nodes, [Queue("q")], groups, [])
    assert not placed(result, "big")
    assert "no fit" in result.pending["big"]
    assert len(placed(result, "small")) == 1


def test_pods_beyond_min_member_are_placed_when_they_fit() -> None:
    nodes = [gpu_node("n0"), gpu_node("n1")]
    group = gang("elastic", 3, gpus=8, min_member=2)
    result = run_session(nodes, [Queue("q")], [group], [])
    assert len(placed(result, "elastic")) == 2
    assert "elastic" not in result.pending


def test_backfill_does_not_eat_the_room_of_the_waiting_gang() -> None:
    # n0 is half busy, n1 free: the 2x8-GPU gang waits; a small pod of no higher priority may use n0's
    # leftover (the gang cannot use it now) but not n1, where one of the gang's pods fits
    nodes = [gpu_node("n0"), gpu_node("n1")]
    busy = gang("busy", 1, gpus=4)
    running = running_on(busy, ["n0"], [(0, 1, 2, 3)])
    groups = [busy, gang("gang", 2, gpus=8, created=1), gang("small", 1, gpus=4, created=2)]
    result = run_session(nodes, [Queue("q")], groups, running)
    assert not placed(result, "gang")
    assert [p.node for p in placed(result, "small")] == ["n0"]
    groups += [gang("wide", 1, gpus=8, created=3)]
    result = run_session(nodes, [Queue("q")], groups, running)
    assert not placed(result, "wide") and "wide" in result.pending
    # a higher-priority pod is not held back by a waiting gang of lower priority
    groups[-1] = gang("wide", 1, gpus=8, created=3, priority=1)
    result = run_session(nodes, [Queue("q")], groups, running)
    assert [p.node for p in placed(result, "wide")] == ["n1"]
    # and with no gang waiting, the same pod just runs
    result = run_session(nodes, [Queue("q")], [busy, groups[-1]], running)
    assert placed(result, "wide")


def test_preemption_evicts_overcommitted_first_and_only_what_is_needed() -> None:
    nodes = [gpu_node("n0"), gpu_node("n1"), gpu_node("n2")]
    cap = Resources(2**40, 2**40, 16_000)
    queues = [Queue("q", capability=cap, overcommit=True)]
    low_old = gang("low-old", 1, priority=0, created=0)
    low_new = gang("low-new", 1, priority=0, created=1)
    low_over = gang("low-over", 1, priority=1, created=2)  # admitted past the capability: overcommitted
    high = gang("high", 1, priority=5, created=3)
    running = (
        running_on(low_old, ["n0"], [tuple(range(8))])
        + running_on(low_new, ["n1"], [tuple(range(8))])
        + running_on(low_over, ["n2"], [tuple(range(8))])
    )
    result = run_session(nodes, queues, [low_old, low_new, low_over, high], running)
    assert {p.pod.group for p in result.evictions} == {"low-over"}
    assert [p.node for p in placed(result, "high")] == ["n2"]
    assert "low-over" in result.overcommitted


def test_preemption_never_evicts_for_a_group_that_still_would_not_fit() -> None:
    nodes = [gpu_node("n0"), gpu_node("n1")]
    low = gang("low", 1, priority=0)
    high = gang("high", 3, gpus=8, priority=9)  # needs 3 nodes: the cluster has 2
    running = running_on(low, ["n0"], [tuple(range(8))])
    result = run_session(nodes, [Queue("q")], [low, high], running)
    assert result.evictions == [] and result.placements == []
    assert "no fit" in result.pending["high"]


def test_preemption_takes_a_gang_whole() -> None:
    nodes = [gpu_node(f"n{i}") for i in range(4)]
    low = gang("low", 4, gpus=2, priority=0)  # 2 GPUs on each node
    fill = gang("fill", 4, gpus=6, priority=7)  # above 'high': never a victim
    high = gang("high", 1, gpus=8, priority=5)
    running = running_on(low, [f"n{i}" for i in range(4)], [(0, 1)] * 4) + running_on(
        fill, [f"n{i}" for i in range(4)], [(2, 3, 4, 5, 6, 7)] * 4
    )
    result = run_session(nodes, [Queue("q")], [low, fill, high], running)
    # 'low' must go (lowest priority) but frees only 2 GPUs per node: 'high' still would not fit -> nothing
    assert result.evictions == []
    high2 = gang("high", 1, gpus=2, priority=5)
    result = run_session(nodes, [Queue("q")], [low, fill, high2], running)
    assert sorted(p.pod.name for p in result.evictions) == [f"low-{k}" for k in range(4)]
    assert len(placed(result, "high")) == 1


def test_reclaim_takes_back_only_above_guaranteed() -> None:
    nodes = [gpu_node(f"n{i}") for i in range(4)]
    queues = [
        Queue("a", guaranteed=Resources(0, 0, 16_000)),
        Queue("b", guaranteed=Resources(0, 0, 16_000)),
    ]
    b_jobs = [gang(f"b{i}", 1, queue="b", priority=9, created=i) for i in range(4)]
    running = [pl for i, g in enumerate(b_jobs) for pl in running_on(g, [f"n{i}"], [tuple(range(8))])]
    want = gang("a-job", 2, gpus=8, queue="a", created=10)
    result = run_session(nodes, queues, [*b_jobs, want], running)
    # queue b holds 32 GPUs against 16 guaranteed: two of its groups go (the newest), never below 16
    assert sorted({p.pod.group for p in result.evictions}) == ["b2", "b3"]
    assert len(placed(result, "a-job")) == 2
    # a queue already at its guaranteed does not reclaim
    more = gang("a-more", 1, gpus=8, queue="a", created=11)
    a_running = running_on(want, ["n2", "n3"], [tuple(range(8))] * 2)
    rest = [p for p in running if p.pod.group in ("b0", "b1")]
    result = run_session(nodes, queues, [*b_jobs[:2], want, more], rest + a_running)
    assert result.evictions == [] and "a-more" in result.pending
    # nor does any queue take from a queue that is not reclaimable
    queues[1] = Queue("b", guaranteed=Resources(0, 0, 16_000), reclaimable=False)
    result = run_session(nodes, queues, [*b_jobs, want], running)
    assert result.evictions == []


def test_multi_gpu_pod_stays_in_one_nvlink_group_then_one_numa_domain() -> None:
    # NVLink groups of 2, NUMA domains of 4; GPUs 0 and 2 busy: a 2-GPU pod fits only in group {4,5} or {6,7}
    node = gpu_node("n0", nvlink=2, numa=4)
    busy = gang("busy", 2, gpus=1)
    running = running_on(busy, ["n0", "n0"], [(0,), (2,)])
    result = run_session([node], [Queue("q")], [busy, gang("two", 1, gpus=2)], running)
    gpus = placed(result, "two")[0].gpus
    assert {g // 2 for g in gpus} in ({2}, {3})
    # no NVLink pair left: one NUMA domain (the one with GPUs 4..7 free) rather than a span
    busy4 = gang("busy", 4, gpus=1)
    running = running_on(busy4, ["n0"] * 4, [(0,), (2,), (4,), (6,)])
    result = run_session([node], [Queue("q")], [busy4, gang("two", 1, gpus=2)], running)
    gpus = placed(result, "two")[0].gpus
    assert len({g // 4 for g in gpus}) == 1
    # with the topology plugin off, the first free GPUs are taken, spanning NVLink groups
    result = run_session([node], [Queue("q")], [busy4, gang("two", 1, gpus=2)], running, Weights(topology=0))
    assert placed(result, "two")[0].gpus == (1, 3)


def test_topology_prefers_the_node_with_a_whole_nvlink_group() -> None:
    a, b = gpu_node("a", gpus=4, nvlink=2), gpu_node("b", gpus=4, nvlink=2)
    busy = gang("busy", 2, gpus=1)
    running = running_on(busy, ["a", "b"], [(0,), (3,)])  # a: {1} | {2,3} free; b: {0,1} | {2} free
    groups = [busy, gang("two", 1, gpus=2)]
    # both nodes hold a free NVLink pair; break 'a' so only 'b' does
    busy3 = gang("busy", 3, gpus=1)
    running = running_on(busy3, ["a", "a", "b"], [(0,), (2,), (3,)])
    result = run_session(
        [a, b], [Queue("q")], [busy3, groups[1]], running, Weights(binpack=0, fragmentation=0)
    )
    assert placed(result, "two")[0].node == "b"
    assert set(placed(result, "two")[0].gpus) == {0, 1}


def test_sharing_pod_takes_the_gpu_its_score_was_taken_on() -> None:
    node = gpu_node("n0", gpus=4)
    busy = gang("busy", 2, gpus=1, milli=300)
    running = running_on(busy, ["n0", "n0"], [(1,), (2,)])
    grown = PodGroup("busy", "q", [*busy.pods, Pod("busy-x", "busy", 0, 0, 1, 400)], min_member=2)
    running += [Placement(grown.pods[-1], "n0", (2,))]  # GPU 2: 300 + 400 used, 300 free
    groups = [grown, gang("s", 1, gpus=1, milli=250)]
    # Free: 1000, 700, 300, 1000. The tightest GPU (2) would be left a 50-milli sliver that none of the
    # 250-400-milli shapes fits; on the 700-free one 450 stay, room for any of them (the trace policy's
    # choice: every fitting GPU scored, the best kept). Not an empty GPU either.
    assert placed(run_session([node], [Queue("q")], groups, running), "s")[0].gpus == (1,)
    # Without the fragmentation score: the first GPU that fits.
    plain = run_session([node], [Queue("q")], groups, running, Weights(fragmentation=0))
    assert placed(plain, "s")[0].gpus == (0,)


def test_sharing_pod_among_equally_scored_gpus_keeps_nvlink_groups_whole() -> None:
    node = gpu_node("n0", gpus=8)  # NVLink groups 0-3 and 4-7
    halves = gang("halves", 2, gpus=1, milli=500)
    whole = gang("whole", 1, gpus=1)
    running = running_on(halves, ["n0", "n0"], [(1,), (5,)]) + running_on(whole, ["n0"], [(6,)])
    groups = [halves, whole, gang("s", 1, gpus=1, milli=500)]
    # GPUs 1 and 5 have 500 free each and score alike; the second group has fewer whole GPUs left (2
    # against 3), so the pod goes there and leaves the first whole group of 3 for a multi-GPU pod.
    assert placed(run_session([node], [Queue("q")], groups, running), "s")[0].gpus == (5,)
    # Without the topology score: the lowest of the equally scored GPUs, as the trace policy takes.
    plain = run_session([node], [Queue("q")], groups, running, Weights(topology=0))
    assert placed(plain, "s")[0].gpus == (1,)


def test_tor_packs_a_gang_under_one_switch() -> None:
    # 2 ToRs of 4 nodes; t0 has 3 busy nodes, t1 is empty: a 4-node gang goes to t1, not across both
    nodes = [gpu_node(f"a{i}", tor="t0") for i in range(4)] + [gpu_node(f"b{i}", tor="t1") for i in range(4)]
    busy = gang("busy", 3, gpus=8)
    running = running_on(busy, ["a1", "a2", "a3"], [tuple(range(8))] * 3)
    job = gang("job", 4, gpus=8)
    result = run_session(nodes, [Queue("q")], [busy, job], running)
    assert {p.node for p in placed(result, "job")} == {f"b{i}" for i in range(4)}
    result = run_session(nodes, [Queue("q")], [busy, job], running, Weights(tor=0))
    assert {p.node[0] for p in placed(result, "job")} == {"a", "b"}  # without the ToR score it spans both


def test_tor_keeps_later_pods_of_a_gang_with_the_first() -> None:
    nodes = [gpu_node(f"a{i}", tor="t0", gpus=4) for i in range(3)] + [
        gpu_node(f"b{i}", tor="t1", gpus=4) for i in range(3)
    ]
    job = gang("job", 3, gpus=2)
    result = run_session(nodes, [Queue("q")], [job], [], Weights(binpack=0, fragmentation=0))
    tors = {p.node[0] for p in placed(result, "job")}
    assert len(tors) == 1


def test_locality_prefers_the_warm_node_between_equals() -> None:
    data = "s3://bucket/imagenet"
    nodes = [gpu_node("a"), gpu_node("b", cached={data: 1.0}), gpu_node("c", cached={data: 0.3})]
    job = gang("job", 1, gpus=4, datasets=(data,))
    assert placed(run_session(nodes, [Queue("q")], [job], []), "job")[0].node == "b"
    # off: the tie goes to the lowest name
    assert placed(run_session(nodes, [Queue("q")], [job], [], Weights(locality=0)), "job")[0].node == "a"


def test_locality_never_breaks_a_gang_or_a_hard_constraint() -> None:
    data = "s3://bucket/ds"
    # the warm node is big enough for either pod, but the cold one only for the small pod
    warm = gpu_node("warm", gpus=8, cached={data: 1.0}, labels={"zone": "a"})
    cold = gpu_node("cold", gpus=2, labels={"zone": "a"})
    far = gpu_node("far", gpus=8, cached={data: 1.0}, labels={"zone": "b"})
    job = PodGroup(
        "job",
        "q",
        [
            Pod("small", "job", 1000, 1000, 2, MILLI, datasets=(data,), node_selector={"zone": "a"}),
            Pod("large", "job", 1000, 1000, 8, MILLI, datasets=(data,), node_selector={"zone": "a"}),
        ],
        min_member=2,
    )
    result = run_session([warm, cold, far], [Queue("q")], [job], [], Weights(locality=100.0))
    where = {p.pod.name: p.node for p in placed(result, "job")}
    assert where == {"large": "warm", "small": "cold"}


def test_unknown_queue_waits_with_a_reason() -> None:
    result = run_session([gpu_node("n0")], [Queue("q")], [gang("lost", 1, queue="ghost")], [])
    assert result.placements == []
    assert result.pending == {"lost": "queue 'ghost' is unknown"}


def test_weight_fair_order_serves_the_queue_with_the_lower_share() -> None:
    nodes = [gpu_node("n0")]
    queues = [Queue("heavy"), Queue("light")]
    old = gang("old", 1, gpus=4, queue="heavy", priority=9)  # not preemptible by 'h'
    running = running_on(old, ["n0"], [(0, 1, 2, 3)])
    groups = [
        old,
        gang("h", 1, gpus=4, queue="heavy", priority=9),
        gang("l", 1, gpus=4, queue="light", created=5),
    ]
    result = run_session(nodes, queues, groups, running)
    assert placed(result, "l") and not placed(result, "h")


def test_deterministic() -> None:
    nodes = [gpu_node(f"n{i}", tor=f"t{i // 2}") for i in range(6)]
    groups = [gang(f"g{i}", 1 + i % 3, gpus=1 + i % 4, created=i) for i in range(8)]
    first = run_session(nodes, [Queue("q")], groups, [])
    assert run_session(list(reversed(nodes)), [Queue("q")], list(reversed(groups)), []) == first


def test_overcommit_marks_the_group_that_takes_the_queue_past_capability_in_this_session() -> None:
    # each group alone fits the capability; the second admitted in the same session takes the queue past it
    cap = Resources(2**40, 2**40, 8000)
    queues = [Queue("o", capability=cap, overcommit=True)]
    groups = [gang("x", 1, queue="o", created=0), gang("y", 1, queue="o", created=1)]
    result = run_session([gpu_node("n0"), gpu_node("n1")], queues, groups, [])
    assert len(result.placements) == 2
    assert result.overcommitted == ["y"]


def test_negative_requests_wait_and_never_inflate_a_node() -> None:
    nodes = [gpu_node("n0", cpu=4000)]
    groups = [gang("neg", 1, gpus=0, cpu=-8000, created=0), gang("big", 1, gpus=0, cpu=10_000, created=1)]
    result = run_session(nodes, [Queue("q")], groups, [])
    assert result.placements == []
    assert "negative" in result.pending["neg"]
    assert over_allocated(nodes, result.placements) == []


def test_a_gang_held_back_by_its_quota_does_not_reserve_room() -> None:
    # queue a may hold 16 GPUs: after a1, a2 (2 x 8) cannot run whatever the room, so it must not hold
    # back queue b's pod (lower share goes first: queue b already runs 'old', so a2 comes before b)
    nodes = [gpu_node(f"n{i}") for i in range(4)]
    queues = [Queue("a", capability=Resources(2**40, 2**40, 16_000)), Queue("b")]
    old = gang("old", 1, queue="b")
    groups = [
        old,
        gang("a1", 1, queue="a"),
        gang("a2", 2, queue="a", created=1),
        gang("b", 1, queue="b", created=2),
    ]
    result = run_session(nodes, queues, groups, running_on(old, ["n3"], [tuple(range(8))]))
    assert placed(result, "a1") and placed(result, "b")
    assert result.pending["a2"].startswith("quota")


def test_fragmentation_cache_survives_the_empty_cluster_check() -> None:
    # 'big' fails and is checked against an empty cluster; the scores cached there must not leak: 's' then
    # fills n0's half-used node (fragment filled) rather than breaking the empty node m
    a = {"zone": "a"}
    nodes = [
        gpu_node("m", labels={"zone": "b"}),
        gpu_node("n0", labels=a),
        gpu_node("n1", gpus=4, labels=a),
        gpu_node("n2", gpus=4, labels=a),
        gpu_node("z", labels={"zone": "c"}),
    ]
    b0, b1, b2 = (gang(f"b{i}", 1, gpus=4 if i == 0 else 1, priority=9) for i in range(3))
    zz = gang("zz", 1, queue="q2", priority=9)
    running = (
        running_on(b0, ["n0"], [(0, 1, 2, 3)])
        + running_on(b1, ["n1"], [(0,)])
        + running_on(b2, ["n2"], [(0,)])
        + running_on(zz, ["z"], [tuple(range(8))])
    )
    big = gang("big", 2, gpus=4, selector=a, created=1)
    s = gang("s", 1, gpus=4, queue="q2", priority=1, created=2)
    result = run_session(
        nodes, [Queue("q"), Queue("q2")], [b0, b1, b2, zz, big, s], running, Weights(binpack=0)
    )
    assert [p.node for p in placed(result, "s")] == ["n0"]


def test_an_evicted_group_is_not_placed_in_the_same_session() -> None:
    # h evicts w (w's running pod is on n0, which h can reach); w must not then evict l0 for its pending pod:
    # that would leave w half evicted, half placed
    a, b = {"zone": "a"}, {"zone": "b"}
    nodes = [gpu_node("n0", labels=a), gpu_node("n1", labels=a), gpu_node("n2", labels=b)]
    w = gang("w", 2, priority=1)
    l1, l0 = gang("l", 1, priority=2, created=1), gang("l0", 1, priority=0, created=2)
    h = gang("h", 1, priority=5, created=3, selector=a)
    running = [
        Placement(w.pods[0], "n0", tuple(range(8))),
        *running_on(l1, ["n1"], [tuple(range(8))]),
        *running_on(l0, ["n2"], [tuple(range(8))]),
    ]
    result = run_session(nodes, [Queue("q")], [w, l1, l0, h], running)
    assert {p.pod.group for p in result.evictions} == {"w"}
    assert [p.pod.group for p in result.placements] == ["h"]


def test_room_freed_for_one_group_is_not_taken_by_another() -> None:
    # A evicts the gang v (on n0 and n1) to run on n0; B (below v's priority) must not run on n1 with
    # the room v left there, though evicting its own candidate v1 lets it 'fit' in simulation
    a, b = {"zone": "a"}, {"zone": "b"}
    nodes = [gpu_node("m", labels=b), gpu_node("n0", labels=a), gpu_node("n1", labels=b)]
    v, hi, v1 = gang("v", 2, priority=5), gang("hi", 1, gpus=6, priority=9), gang("v1", 1, gpus=2, priority=1)
    running = (
        running_on(v, ["n0", "n1"], [tuple(range(8))] * 2)
        + running_on(hi, ["m"], [tuple(range(6))])
        + running_on(v1, ["m"], [(6, 7)])
    )
    groups = [
        v,
        hi,
        v1,
        gang("A", 1, priority=10, selector=a, created=1),
        gang("B", 1, priority=3, created=2),
    ]
    result = run_session(nodes, [Queue("q")], groups, running)
    assert {p.pod.group for p in result.evictions} == {"v"}
    assert [p.pod.group for p in result.placements] == ["A"]
    assert "B" in result.pending


def test_edge_cases_do_not_crash() -> None:
    group = gang("g", 2, gpus=1)
    assert run_session([], [Queue("q")], [group], []).pending["g"].startswith("no fit")
    no_gpu = Node("cpu", 8000, 8000)
    assert run_session([no_gpu], [Queue("q")], [group], []).placements == []
    huge = gang("huge", 1, gpus=16)
    assert run_session([gpu_node("n0")], [Queue("q")], [huge], []).placements == []
    short = gang("short", 2, min_member=3)
    assert (
        "fewer than min_member" in run_session([gpu_node("n0")], [Queue("q")], [short], []).pending["short"]
    )
    zero = Queue("q", capability=Resources())
    assert run_session([gpu_node("n0")], [zero], [group], []).pending["g"].startswith("quota")
    # running pods on an unknown node, or on GPU indexes the node lacks: counted in quota, nothing breaks
    ghost = gang("ghost", 2, gpus=1, priority=9)
    running = [Placement(ghost.pods[0], "gone", (0,)), Placement(ghost.pods[1], "n0", (42,))]
    result = run_session([gpu_node("n0")], [Queue("q")], [ghost, gang("x", 1, gpus=8)], running)
    assert over_allocated([gpu_node("n0")], [p for p in after(running, result) if p.node == "n0"]) == []


# --- the synthetic simulations (pffs/scheduler/replay/synthetic.py) -----------------------------------


def test_simulation_gang_aware_never_holds_a_partial_gang_and_gangless_does() -> None:
    # 4 nodes; x holds two until t=1000; gang a (3 nodes) and gang b (2 nodes) arrive while it runs
    jobs = [Job("x", 0.0, 1000.0, 2, 8), Job("a", 10.0, 500.0, 3, 8), Job("b", 20.0, 500.0, 2, 8)]
    gang_ = simulate(make_cluster(4), jobs, "gang", start_timeout=300.0)
    assert gang_.started == 3 and gang_.partial_gang_gpu_hours == 0 and gang_.restarts == 0
    # gang-less: a's first two pods take the free nodes and wait idle for its third
    held = simulate(make_cluster(4), jobs, "gangless", start_timeout=None)
    assert held.started == 3 and held.restarts == 0
    assert held.partial_gang_gpu_hours > 16 * 900 / 3600  # 16 GPUs idle from t=10 until x ends, at least
    assert held.partial_peak_gpus == 16
    # with a start timeout, a gives up after 300 s, is restarted behind b, and b runs first
    timed = simulate(make_cluster(4), jobs, "gangless", start_timeout=300.0)
    assert timed.started == 3 and timed.restarts == 1
    assert timed.wait_by_kind["gang"] < held.wait_by_kind["gang"]


def test_simulation_gangless_places_later_pods_past_one_that_does_not_fit() -> None:
    # one node, 6 GPUs busy: an 8-GPU pod that waits does not keep a later 1-GPU pod out (no reservation)
    jobs = [Job("busy", 0.0, 1000.0, 1, 6), Job("big", 5.0, 100.0, 1, 8), Job("small", 6.0, 100.0, 1, 1)]
    gangless = simulate(make_cluster(1), jobs, "gangless")
    assert gangless.wait_by_kind["1-gpu"] < 10 and gangless.wait_by_kind["8-gpu"] > 900
    # run_session keeps room only for a waiting gang of two or more pods: on lone pods the two agree
    assert simulate(make_cluster(1), jobs, "gang").wait_by_kind == gangless.wait_by_kind


def test_simulation_locality_reads_warm_from_the_node_that_holds_the_dataset() -> None:
    size = 100 * 10**9
    jobs = [
        Job("j0", 0.0, 200.0, 1, 8),  # fills node000: j1 reads the dataset on node001
        Job("j1", 0.0, 100.0, 1, 4, dataset="s3://d", size=size),
        Job("j2", 400.0, 5000.0, 1, 4),  # on node000 (lowest name): the fuller node is now the cold one
        Job("j3", 1000.0, 100.0, 1, 4, dataset="s3://d", size=size),
    ]
    on = simulate(make_cluster(2), jobs, weights=Weights(), cache_bytes=10**12)
    off = simulate(make_cluster(2), jobs, weights=Weights(locality=0), cache_bytes=10**12)
    assert on.backend_bytes == size and on.warm_fraction == 0.5
    assert off.backend_bytes == 2 * size and off.warm_fraction == 0.0
    assert on.data_seconds_mean < off.data_seconds_mean


def session_with_shapes_seen(
    nodes: list[Node], groups: list[PodGroup]
) -> tuple[SessionResult, list[TypicalShapes]]:
    """A session of ``groups`` on ``nodes``, and the typical shapes its fragmentation score was given."""
    seen: list[TypicalShapes] = []
    original = scoring.waste_growth

    def spy(state, shapes, pod):
        seen.append(shapes)
        return original(state, shapes, pod)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(scoring, "waste_growth", spy)
        return run_session(nodes, [Queue("q")], groups, []), seen


def test_session_keeps_the_rare_shape_only_its_few_big_nodes_can_run() -> None:
    """The session builds its shapes as the trace policy does from its own nodes: the 8-GPU, 120-core pod
    is rarer than FGD's shapes reach, but only one node of twenty can run it, so it joins them at full
    scarcity (its one pod asks for all 8 of that node's GPUs)."""
    nodes = [gpu_node(f"n{i:02}", cpu=96_000) for i in range(19)] + [gpu_node("big", cpu=128_000)]
    groups = [gang(f"one{i}", 1, gpus=1, cpu=8000) for i in range(40)] + [
        gang("eight", 1, gpus=8, cpu=120_000)
    ]
    result, seen = session_with_shapes_seen(nodes, groups)
    assert seen and {p.pod.name: p.node for p in result.placements}.get("eight-0") == "big"
    shapes = seen[0]
    assert sorted(zip(shapes.cpu.tolist(), shapes.count.tolist(), strict=True)) == [(8000, 1), (120_000, 8)]
    # weights: 40 one-GPU pods at 1 each against one 8-GPU pod at 1/8 x scarcity 20
    by_count = dict(zip(shapes.count.tolist(), shapes.prob.tolist(), strict=True))
    assert by_count[8] / by_count[1] == pytest.approx((20 / 8) / 40)


def test_session_keeps_the_small_gpu_model_for_the_pods_bound_to_it() -> None:
    """Shapes bound to a GPU model weigh against that model's GPUs, as in the trace policy: three pods need
    model B (one node, 8 of the 80 GPUs), six need A, so a pod that accepts any model goes to an A node,
    though the B node's name comes first and nothing else tells the nodes apart."""
    nodes = [gpu_node("a-b", model="B")] + [gpu_node(f"n{i}", model="A") for i in range(9)]
    groups = [gang("any", 1, gpus=1, created=0.0)]
    groups += [gang(f"a{i}", 1, gpus=1, created=1.0, models=frozenset({"A"})) for i in range(6)]
    groups += [gang(f"b{i}", 1, gpus=1, created=1.0, models=frozenset({"B"})) for i in range(3)]
    result, seen = session_with_shapes_seen(nodes, groups)
    assert {p.pod.name: p.node for p in result.placements}["any-0"] != "a-b"
    shapes = seen[0]
    capacities = NodeCapacities(np.full(10, 64_000), np.full(10, 8), np.array([2] + [1] * 9))
    by_mask = dict(zip(shapes.model_mask.tolist(), shapes.scarcity(capacities).tolist(), strict=True))
    assert by_mask == pytest.approx({ANY_MODEL: 1.0, 1: 80 / 72, 2: 80 / 8})  # A's bit 1, B's bit 2


def test_session_measures_stranding_with_the_trace_policys_weights() -> None:
    """The gang session's fragmentation score uses the typical shapes weighted as the trace policy's
    (``TypicalShapes.for_stranding``): multi-GPU shapes divided by their GPU count, sharing ones doubled."""
    groups = [gang("eight", 1, gpus=8, cpu=2000), gang("one", 3, gpus=1, cpu=1000), gang("half", 1, 1, 500)]
    result, seen = session_with_shapes_seen([gpu_node("a"), gpu_node("b")], groups)
    assert len(result.placements) == 5 and seen
    counts = {(2000, MILLI, 8, ""): 1, (1000, MILLI, 1, ""): 3, (1000, 500, 1, ""): 1}
    expected = TypicalShapes.from_counts(counts, lambda spec: ANY_MODEL).for_stranding()
    got = {
        (c, s, k): p
        for c, s, k, p in zip(seen[0].cpu, seen[0].share, seen[0].count, seen[0].prob, strict=True)
    }
    # weights 1/8, 3 and 2 (the sharing shape doubled), over 5.125
    assert got == pytest.approx(
        {(2000, MILLI, 8): 0.125 / 5.125, (1000, MILLI, 1): 3 / 5.125, (1000, 500, 1): 2 / 5.125}
    )
    assert np.allclose(np.sort(seen[0].prob), np.sort(expected.prob))
