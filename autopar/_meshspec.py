"""Parsing a mesh written as text; no jax import, so the CLI can read it before jax starts."""

from autopar.errors import MeshError


def parse_mesh_spec(text: str) -> dict[str, int]:
    """'data=2,model=4' -> {'data': 2, 'model': 4}."""
    axes = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        name, size = name.strip(), size.strip()
        if sep and name and size.lstrip("+-").isdigit() and int(size) < 1:
            raise MeshError(f"mesh `{text}`: axis `{name}` has size {size}; sizes must be at "
                            "least 1, e.g. data=2,model=4")
        if sep and name and size and not size.isdigit():
            raise MeshError(f"mesh `{text}`: the size of axis `{name}` is `{size}`, not a whole "
                            "number; e.g. data=2,model=4")
        if not sep or not name or not size.isdigit():
            raise MeshError(f"malformed mesh `{text}` at `{part.strip()}`: write it as name=size "
                            "pairs joined by commas, e.g. data=2,model=4")
        if not name.isascii() or not (name[0].isalpha() or name[0] == "_") or not all(
                ch.isalnum() or ch in "_.-" for ch in name):
            raise MeshError(f"mesh `{text}`: axis name `{name}` is not an ASCII word; use "
                            "letters, digits, '_', '.' or '-', starting with a letter or '_', "
                            "e.g. data=2,model=4")
        if name in axes:
            raise MeshError(f"mesh `{text}` names axis `{name}` twice: give each axis once, "
                            "with its size")
        axes[name] = int(size)
    return axes
