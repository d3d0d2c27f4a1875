"""The plans of a built cuDNN graph: which indices built, their count and
their names, and a plan's timing under autotune (:mod:`fastchain.cudnn._graphs`)."""

import statistics

import numpy

# A plan whose first trial took more than this many times the best median so
# far gets no more trials: it cannot be picked. On the first GPU run the plans
# of cuDNN's engine 0 made 70% of the summed medians of the keys tuned (1.46 s
# of 2.10 s over 136 keys), each timed 16 runs.
SLOW = 3.0


def plan_count(graph):
    """Plans in the list (an older frontend without per-plan calls: one, the
    heuristics' choice)."""
    count = getattr(graph, 'get_execution_plan_count', None)
    return count() if count is not None else 1


def more_plans(g, want, cudnn):
    """Builds ``g``'s plans one index at a time, in the heuristics' order,
    until ``want`` have built or none is left; ``g.plans`` lists those that
    built. Frontend 1.32 keeps every plan in its list, those cuDNN
    deselected (numeric notes, the workspace limit) included, and building
    one raises ("Chosen plan index has been deselected.", a RuntimeError):
    its own ``build_plans(ALL)`` stops at the first such, so each index is
    built on its own here and one that fails is passed over (the first
    reason kept in ``g.error``). A frontend without ``build_plan_at_index``
    walks its own list: for the heuristics' choice, then once more for all
    of it when more are wanted (autotune after a key ran without)."""
    build_at = getattr(g.graph, 'build_plan_at_index', None)
    if build_at is None:
        # its own walk: the heuristics' choice, or all of them once more are wanted
        wanted = 2 if want > 1 else 1
        if g.walked < wanted:
            g.walked, g.next = wanted, g.count
            try:
                g.graph.build_plans(cudnn.build_plan_policy.ALL if want > 1
                                    else cudnn.build_plan_policy.HEURISTICS_CHOICE)
            except Exception as e:
                if is_oom(e):
                    raise
                g.error = describe_error(e)
            g.plans = runnable(g.graph)
        return
    while len(g.plans) < want and g.next < g.count:
        index = g.next
        g.next += 1
        try:
            build_at(index)
        except Exception as e:
            if is_oom(e):
                raise
            g.error = g.error or 'plan {}: {}'.format(index, describe_error(e))
            continue
        g.plans.append(index)


def describe_error(e):
    text = str(e).strip()
    return '{}: {}'.format(type(e).__name__, text.splitlines()[0] if text else '')


def runnable(graph):
    """Indices of the plans that built: those whose workspace the frontend
    can tell (a deselected or unbuilt one raises there)."""
    size_of = getattr(graph, 'get_workspace_size_plan_at_index', None)
    if size_of is None:
        return [0]          # an older frontend: the heuristics' choice, one plan
    out = []
    for i in range(plan_count(graph)):
        try:
            size_of(i)
        except Exception:
            continue
        out.append(i)
    return out


def plan_label(g, plan):
    """'nchw plan 3 (engine name)': how a candidate reads in reports and in
    a cache file (the engine's name, where the frontend gives it, so a
    changed plan list does not reuse a stale pick)."""
    name_of = getattr(g.graph, 'get_plan_name_at_index', None)
    try:
        name = name_of(plan) if name_of is not None else None
    except Exception:
        name = None
    return '{} plan {}{}'.format(g.layout, plan, ' ({})'.format(name) if name else '')


def is_oom(e):
    """CuPy's out-of-memory: a condition of the moment, not of the key."""
    return type(e).__name__ == 'OutOfMemoryError'


def time_plan(run, events, trials, repeats, best=None):
    """Median ms of ``run``'s trials, after one untimed run (first-call
    costs, caches): each trial ``repeats`` runs back to back between one
    pair of CUDA ``events`` (the host's time to launch a run hides behind
    the runs queued before it). One trial only where it took more than
    ``SLOW`` times ``best``."""
    import cupy
    start, end = events
    run()
    times = []
    for _ in range(trials):
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / repeats)
        if best is not None and times[0] > SLOW * best:
            break
    return statistics.median(times)


def workspace_for(graph, plan):
    """A workspace for ``plan`` of ``graph`` (a ``_graphs._Graph``) from CuPy's
    pool; the plan's size asked of the frontend once."""
    import cupy
    size = graph.workspace.get(plan)
    if size is None:
        size_of = getattr(graph.graph, 'get_workspace_size_plan_at_index', None)
        if size_of is None:         # an older frontend: the graph's, asked each time
            size = graph.graph.get_workspace_size()
        else:
            size = graph.workspace[plan] = size_of(plan)
    return cupy.empty(max(1, size), dtype=numpy.uint8)
