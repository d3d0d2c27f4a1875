"""The plans of a built cuDNN graph: which indices built, their count and
their names (:mod:`fastchain.cudnn._graphs`)."""


def plan_count(graph):
    """Plans in the list (an older frontend without per-plan calls: one, the
    heuristics' choice)."""
    count = getattr(graph, 'get_execution_plan_count', None)
    return count() if count is not None else 1


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
