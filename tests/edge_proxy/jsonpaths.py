"""Walking and editing JSON values by path, for the fuzz tests (public WS and OpenAI HTTP)."""


def paths(obj, path=()):
    """Every path into `obj` (dict keys and list indexes), `()` for the whole."""
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, path + (i,))


def set_at(obj, path, value) -> None:
    for p in path[:-1]:
        obj = obj[p]
    obj[path[-1]] = value
