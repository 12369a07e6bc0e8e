"""Tensor parallelism as composite devices: a stage on t identical devices of one node, each doing ~1/t
of the work plus the collectives between them (Megatron-style), planned by the ordinary solver.

A degree assignment maps each device class (type, memory) to a degree t (1: none). ``composite_problem``
groups, on each node, the class's devices in index order into floor(n / t) groups of t (the rest stay
single) and makes each group one device of type ``f"{type}/tp{t}"``, costed per block by the problem's
``TensorSplit`` row of degree t: its seconds, and through ``type_bytes`` the bytes each member holds
against the class's per-device memory. Rank j of a group talks to rank j of the next stage's group over
parallel links, so a composite's links are its first member's: one message's time. The result is an
ordinary problem: ``solve``, ``simulate`` and ``evaluate`` run on it unchanged.

``solve_tensor`` searches the assignments, each judged by the simulated step of ``solve`` on its
composite problem (those it compares at once solved in parallel: ``solver.parallel``), and reports a
lower bound valid for every assignment (``tensor_bound``).
``megatron_baseline`` is the layout Megatron-LM users start from, scored by the same model.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

from hetcc.errors import InfeasiblePlanError, PlanFormatError
from hetcc.solver.baselines import uniform_boundaries
from hetcc.solver.bound import Way, lower_bound
from hetcc.solver.objective import evaluate
from hetcc.solver.parallel import Solves
from hetcc.solver.problem import (
    TENSOR_GROUP_MARK,
    PartitionProblem,
    PartitionSolution,
    ProblemDevice,
    WireCodec,
    composite_type,
)
from hetcc.solver.simulate import simulate
from hetcc.solver.solve import Searched

DeviceClass = tuple[str, float]  # (device type, memory_bytes)
Assignment = Mapping[DeviceClass, int]  # device class -> tensor degree (1: none)
DeviceMap = list[tuple[int, ...]]  # per device of a composite problem: the original devices it stands for

EXHAUSTIVE_ASSIGNMENTS = 16  # "auto" solves every assignment up to this many, else descends
DESCENT_ROUNDS = 4  # passes over the classes of the coordinate descent, at most


def group_name(names: Sequence[str]) -> str:
    """The name of the composite device standing for the devices ``names`` (a tensor group)."""
    return "+".join(names)


def allowed_degrees(problem: PartitionProblem) -> dict[DeviceClass, tuple[int, ...]]:
    """Per device class (sorted), the degrees it may run at: 1, and each degree d of a ``TensorSplit`` row
    costing its type where some node holds at least d devices of the class."""
    per_node = Counter((d.node, d.type, d.memory_bytes) for d in problem.devices)
    most: dict[DeviceClass, int] = {}
    for (_, kind, memory), count in per_node.items():
        most[kind, memory] = max(most.get((kind, memory), 0), count)
    rows = problem.tensor_splits or []
    return {
        c: (1, *sorted(r.degree for r in rows if c[0] in r.fwd_s and r.degree <= most[c]))
        for c in sorted(most)
    }


def composite_problem(
    problem: PartitionProblem, assignment: Assignment
) -> tuple[PartitionProblem, DeviceMap]:
    """The ordinary problem in which each tensor-parallel group of ``assignment`` is one device (see the
    module docstring), and per device of it the original device indices it stands for (groups in index
    order, each placed at its first member). Classes missing from ``assignment`` run at degree 1; a
    degree a class may not run at (``allowed_degrees``) raises PlanFormatError."""
    problem.validate()
    allowed = allowed_degrees(problem)
    for c, degree in assignment.items():
        if degree not in allowed.get(c, (1,)):
            raise PlanFormatError(
                f"device class {c[0]} ({c[1]:g} bytes) cannot run at tensor degree {degree!r}",
                hint=f"its degrees: {allowed.get(c, (1,))} (a TensorSplit row, that many devices on a node)",
            )
    groups = _groups(problem, assignment)
    devices = [_composite(problem, members) for members in groups]
    kinds = {(problem.devices[g[0]].type, len(g)) for g in groups if len(g) > 1}
    tables = _tensor_tables(problem, kinds)
    links = {
        name: [[matrix[a[0]][b[0]] for b in groups] for a in groups]
        for name, matrix in (("bandwidth_bps", problem.bandwidth_bps), ("latency_s", problem.latency_s))
    }
    return replace(problem, devices=devices, tensor_splits=None, **links, **tables), groups


def _groups(problem: PartitionProblem, assignment: Assignment) -> DeviceMap:
    """The devices' tensor groups, in the order of their first members."""
    by_node: dict[tuple, list[int]] = {}
    for i, d in enumerate(problem.devices):
        by_node.setdefault((d.node, d.type, d.memory_bytes), []).append(i)
    found = []
    for (_, kind, memory), members in by_node.items():
        degree = assignment.get((kind, memory), 1)
        whole = len(members) - len(members) % degree
        found += [tuple(members[k : k + degree]) for k in range(0, whole, degree)]
        found += [(i,) for i in members[whole:]]
    return sorted(found)


def _composite(problem: PartitionProblem, members: tuple[int, ...]) -> ProblemDevice:
    first = problem.devices[members[0]]
    if len(members) == 1:
        return first
    name = group_name([problem.devices[i].name for i in members])
    return ProblemDevice(name, composite_type(first.type, len(members)), first.memory_bytes, first.node)


def _tensor_tables(problem: PartitionProblem, kinds: Iterable[tuple[str, int]]) -> dict:
    """``fwd_s``, ``bwd_s``, ``wgrad_s``, ``type_bytes`` and ``codecs`` of ``problem`` with the composite
    type of each (type, degree) of ``kinds`` added from its ``TensorSplit`` row (a composite encodes and
    decodes as its members' type does: each rank codes its own copy of the cut)."""
    rows = {row.degree: row for row in problem.tensor_splits or []}
    fwd, bwd = dict(problem.fwd_s), dict(problem.bwd_s)
    wgrad = None if problem.wgrad_s is None else dict(problem.wgrad_s)
    type_bytes = dict(problem.type_bytes or {})
    alias = {}
    for kind, degree in sorted(kinds):
        row, name = rows[degree], composite_type(kind, degree)
        if name in problem.fwd_s:
            raise PlanFormatError(
                f"device type {name!r} is already in the problem",
                hint=f"rename it: {TENSOR_GROUP_MARK!r} marks tensor groups",
            )
        fwd[name], bwd[name], alias[name] = row.fwd_s[kind], row.bwd_s[kind], kind
        if wgrad is not None:
            wgrad[name] = row.wgrad_s[kind]
        optimizer = row.optimizer_bytes or [0.0] * len(problem.blocks)
        type_bytes[name] = {"state_bytes": row.state_bytes, "act_bytes": row.act_bytes,
                            "param_bytes": row.param_bytes, "optimizer_bytes": optimizer}  # fmt: skip
    codecs = None if problem.codecs is None else [_codec_with(row, alias) for row in problem.codecs]
    return {"fwd_s": fwd, "bwd_s": bwd, "wgrad_s": wgrad, "type_bytes": type_bytes or None, "codecs": codecs}


def _codec_with(row: WireCodec, alias: dict[str, str]) -> WireCodec:
    """``row`` with each new type of ``alias`` priced as the type it names."""
    tables = ("encode_s_per_byte", "decode_s_per_byte", "call_s")
    return replace(row, **{t: {**getattr(row, t), **{new: getattr(row, t)[old] for new, old in alias.items()}}
                           for t in tables})  # fmt: skip


def tensor_bound(problem: PartitionProblem, within_s: float = math.inf) -> float:
    """A simulated step no plan of any degree assignment beats: ``bound.lower_bound`` with each class's
    devices free to run blocks alone or in groups of any degree it allows (``bound.Way``), which relaxes
    every assignment at once (``within_s``: as ``lower_bound``'s)."""
    problem.validate()
    allowed = allowed_degrees(problem)
    kinds = {(c[0], d) for c, degrees in allowed.items() for d in degrees if d > 1}
    tables = replace(problem, tensor_splits=None, **_tensor_tables(problem, kinds))
    ways = {c: [Way(composite_type(c[0], d) if d > 1 else c[0], d) for d in ds] for c, ds in allowed.items()}
    return lower_bound(tables, ways, within_s=within_s)


def solve_tensor(
    problem: PartitionProblem, degrees: str | int = "auto", rerank: int = 0,
    searches: dict[tuple, Searched] | None = None,
) -> tuple[PartitionSolution, dict[DeviceClass, int], DeviceMap]:  # fmt: skip
    """The fastest simulated plan over degree assignments: (the plan on the composite problem, its
    assignment, the composite devices' original devices: ``composite_problem``).

    ``degrees`` an int pins it: every class that may run at it does (``allowed_degrees``), the rest at 1;
    one ``solve``. "auto" judges assignments by the simulated step ``solve(composite, rerank)`` reports:
    every one (the product over classes of their allowed degrees, all degree 1 first) when there are at
    most ``EXHAUSTIVE_ASSIGNMENTS``, else a coordinate descent from all degree 1 that gives each class in
    turn its best degree with the others fixed, until a pass changes nothing (at most
    ``DESCENT_ROUNDS`` passes): at most 1 + rounds * sum over classes of (its degrees - 1) solves,
    each assignment solved once (and where a class's solves leave a worker idle, the next class's begun
    there on a guess: ``_descend``); where it ends on no feasible assignment, a second descent from each
    class's largest degree (as many solves again, at most). Infeasible assignments are skipped; if every
    one tried is infeasible, the all-degree-1 problem's InfeasiblePlanError is raised.

    The plan's ``lower_bound_s`` (and ``gap``) is ``tensor_bound``, valid for every assignment, or where
    every assignment of the space was solved and it is larger, the least of their own bounds.

    ``searches`` (``search_key``: a composite's device map and schedule family -> ``solve.Searched``) is
    read and filled: a composite searched before, for another schedule the searches see alike, is only
    re-ranked and refined, and the caller may do so with those it solves here.
    """
    problem.validate()
    allowed = allowed_degrees(problem)
    space = _pinned(allowed, problem, degrees) if degrees != "auto" else _space(allowed)
    exhaustive = len(space) <= EXHAUSTIVE_ASSIGNMENTS
    first = space if exhaustive else _candidates(allowed, dict.fromkeys(allowed, 1), next(iter(allowed)))
    with _Assignments(problem, rerank, searches, first) as solves:
        if exhaustive:
            solves.start(space)
            best = min(space, key=solves.step_s)  # the first of equals: fewer, smaller groups first
        else:
            best = _descend(allowed, solves, dict.fromkeys(allowed, 1))
            if solves.step_s(best) == math.inf:  # nothing near degree 1 fits: again from the largest groups
                best = _descend(allowed, solves, {c: ds[-1] for c, ds in allowed.items()})
    tried = solves.tried
    found = tried[_key(best)]
    if found is None:
        raise solves.errors[0]
    solution, device_map = found
    bound = tensor_bound(problem, within_s=solution.simulated_s)
    if len(tried) == len(space):
        bound = max(bound, min(s.lower_bound_s for s, _ in filter(None, tried.values())))
    gap = solution.simulated_s / bound - 1 if bound > 0 else math.inf
    return replace(solution, lower_bound_s=bound, gap=gap), best, device_map


def search_key(composite: PartitionProblem, device_map: DeviceMap) -> tuple:
    """What names a composite's searches among a problem's (``solve_tensor``'s ``searches``): its devices'
    groups, and GPipe or not (the searches see 1f1b, zb-h1 and zb-h2 alike: ``solve.Searched``)."""
    return tuple(device_map), composite.schedule == "gpipe"


def _space(allowed: dict[DeviceClass, tuple[int, ...]]) -> list[dict[DeviceClass, int]]:
    """Every assignment, all degree 1 first."""
    return [dict(zip(allowed, choice)) for choice in itertools.product(*allowed.values())]


def _pinned(allowed, problem: PartitionProblem, degree) -> list[dict[DeviceClass, int]]:
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise PlanFormatError(
            f"tensor degree must be 'auto' or an integer >= 1, got {degree!r}", hint="e.g. 4"
        )
    if degree > 1 and not any(degree in ds for ds in allowed.values()):
        rows = sorted(row.degree for row in problem.tensor_splits or [])
        raise PlanFormatError(
            f"no device class can run at tensor degree {degree}",
            hint=f"degrees with a TensorSplit row: {rows}; a class needs that many devices on one node",
        )
    return [{c: degree if degree in ds else 1 for c, ds in allowed.items()}]


def _descend(
    allowed: dict[DeviceClass, tuple[int, ...]], solves: _Assignments, start: dict
) -> dict[DeviceClass, int]:
    """Coordinate descent from ``start``: each class in turn takes its best degree, the others fixed.

    A class's candidates are solved at once; where they leave a worker idle while the last of them runs,
    the idle worker starts the next class's candidates on the degree the class is likeliest to take (the
    best of its answers so far). A guess that proves wrong costs only that idle time: every decision is
    the one the plain descent makes."""
    current = dict(start)
    classes = list(allowed)
    for _ in range(DESCENT_ROUNDS):
        changed = False
        for k, c in enumerate(classes):
            candidates = _candidates(allowed, current, c)
            wait, idle = solves.idle_slots(solves.start(candidates))
            for assignment in wait:  # the workers' full rounds: then only the last ones still run
                solves.found(assignment)
            answered = [a for a in candidates if solves.answered(a)]
            if idle and answered:
                likely = min(answered, key=lambda a: (solves.step_s(a), a[c] != current[c]))
                solves.start(_candidates(allowed, likely, classes[(k + 1) % len(classes)]), most=idle)
            best = min(allowed[c], key=lambda d: (solves.step_s({**current, c: d}), d != current[c]))
            changed |= best != current[c]
            current[c] = best
        if not changed:
            break
    return current


def _candidates(allowed: dict[DeviceClass, tuple[int, ...]], current: dict, c: DeviceClass) -> list[dict]:
    """The assignments of class ``c``'s step of the descent: ``current`` with each degree ``c`` allows."""
    return [{**current, c: d} for d in allowed[c]]


def _key(assignment: Mapping[DeviceClass, int]) -> tuple:
    return tuple(sorted(assignment.items()))


class _Assignments:
    """Each degree assignment's composite problem solved once (``parallel.Solves``): started when first
    named, waited for when its answer is first asked. A context manager over the workers, sized by the
    assignments named ``first``."""

    def __init__(self, problem, rerank: int, searches: dict[tuple, Searched] | None, first: list[dict]):
        self.problem, self.rerank = problem, rerank
        self.searches = {} if searches is None else searches
        self.composites = {_key(a): composite_problem(problem, a) for a in first}
        self.started: dict[tuple, Callable] = {}
        self.tried: dict[tuple, tuple[PartitionSolution, DeviceMap] | None] = {}
        self.errors: list[InfeasiblePlanError] = []
        self._solves = Solves([composite for composite, _ in self.composites.values()])

    def __enter__(self) -> _Assignments:
        self._solves.__enter__()
        return self

    def __exit__(self, *error) -> None:
        self._solves.__exit__(*error)

    def start(self, assignments: list[dict], most: int | None = None) -> list[dict]:
        """Start the assignments not started yet (the first ``most`` of them); those it started."""
        fresh = [a for a in assignments if _key(a) not in self.started][:most]
        for assignment in fresh:
            key = _key(assignment)
            if key not in self.composites:
                self.composites[key] = composite_problem(self.problem, assignment)
            composite, device_map = self.composites[key]
            searched = self.searches.get(search_key(composite, device_map))
            self.started[key] = self._solves.submit_searched(composite, self.rerank, searched)
        return fresh

    def idle_slots(self, fresh: list[dict]) -> tuple[list[dict], int]:
        """Of jobs ``fresh`` started together: those the workers run in full rounds, and how many workers
        the rest leave idle after them (0 where jobs are solved here, one after another)."""
        workers = self._solves.workers
        if workers < 2 or len(fresh) % workers == 0:
            return fresh, 0
        return fresh[: len(fresh) - len(fresh) % workers], workers - len(fresh) % workers

    def answered(self, assignment: dict) -> bool:
        return _key(assignment) in self.tried

    def found(self, assignment: dict) -> tuple[PartitionSolution, DeviceMap] | None:
        """The assignment's (plan, device map), None where no plan fits it; waits for its solve."""
        key = _key(assignment)
        if key not in self.tried:
            self.start([assignment])
            solution, searched = self.started[key]()
            composite, device_map = self.composites[key]
            if searched is not None:
                self.searches[search_key(composite, device_map)] = searched
            if isinstance(solution, InfeasiblePlanError):
                self.errors.append(solution)
            self.tried[key] = None if isinstance(solution, InfeasiblePlanError) else (solution, device_map)
        return self.tried[key]

    def step_s(self, assignment: dict) -> float:
        found = self.found(assignment)
        return math.inf if found is None else found[0].simulated_s


def megatron_baseline(
    problem: PartitionProblem,
) -> tuple[PartitionSolution, dict[DeviceClass, int], DeviceMap] | None:
    """Megatron-LM's usual layout, scored like any plan: tensor degree = GPUs per node, one degree on every
    rank as Megatron-LM runs (the largest every class may run at that divides each node's count of like
    devices: a stage's replicas are then groups of one degree, as the runtime needs), a pipeline
    of K stages over the composites with equal numbers of blocks per stage (``uniform_boundaries``),
    data parallel over the rest (stage j on composites j*r .. j*r + r - 1, r = composites // K, the
    leftover idle), for the fewest K whose stages fit their memory; where the problem allows
    recomputation, also for the fewest K that fit with every stage recomputing (Megatron's full
    activation recomputation), and the faster simulated of the two is kept. (Plan with its simulated step,
    assignment, device map) as ``solve_tensor``; None where no K fits."""
    problem.validate()
    per_node = Counter((d.type, d.memory_bytes, d.node) for d in problem.devices)
    allowed = allowed_degrees(problem)
    common = set.intersection(*(set(degrees) for degrees in allowed.values()))
    degree = max(d for d in common if all(n % d == 0 for n in per_node.values()))
    assignment = dict.fromkeys(allowed, degree)
    composite, device_map = composite_problem(problem, assignment)
    units = len(composite.devices)
    modes = (True,) if problem.recompute_all else (False, True) if problem.recompute else (False,)
    fitting = []
    for recompute in modes:
        for k in range(1, min(units, len(composite.blocks)) + 1):
            r = units // k
            groups = [tuple(range(j * r, j * r + r)) for j in range(k)]
            plan = evaluate(composite, uniform_boundaries(len(composite.blocks), k), groups, [recompute] * k)
            if math.isfinite(plan.step_time_s):
                simulated = simulate(
                    composite, plan.boundaries, groups, plan.recompute, stages=plan.stages, events=False
                )
                fitting.append(replace(plan, simulated_s=simulated.step_time_s))
                break
    if fitting:
        return min(fitting, key=lambda plan: plan.simulated_s), assignment, device_map
    return None
