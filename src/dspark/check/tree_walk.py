"""``ast.iter_child_nodes`` and ``ast.walk`` for ``dspark check``'s rules, at a fraction of their cost
(walking the trees was most of the checker's time): the same nodes in the same order, less the
nodes no rule reads: the context and operator tokens (``Load``, ``Store``, ``Add``, ``Eq``, ...),
which have no children, so the order of the others is unchanged. A rule tests an operator through
its parent (``isinstance(node.op, ast.Div)``), never by walking to it.

Example::

    [type(n).__name__ for n in walk(ast.parse("f(x)").body[0])]   # ['Expr', 'Call', 'Name', 'Name']
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator

__all__ = ["child_nodes", "dotted_key", "walk"]

# fields that hold a token (ctx, op, ops) or never a node (names, numbers, flags)
_NOT_NODES = frozenset({"ctx", "op", "ops", "id", "attr", "arg", "name", "asname", "module", "level",
                        "kind", "type_comment", "conversion", "is_async", "simple", "tag"})
_FIELDS: dict[type, tuple[str, ...]] = {ast.Constant: ()}


def child_nodes(node: ast.AST) -> list[ast.AST]:
    """``list(ast.iter_child_nodes(node))`` less the context and operator tokens, in field order."""
    fields = _FIELDS.get(node.__class__)
    if fields is None:
        fields = _FIELDS[node.__class__] = tuple(f for f in node._fields if f not in _NOT_NODES)
    out: list[ast.AST] = []
    for name in fields:
        value = getattr(node, name, None)
        if isinstance(value, ast.AST):
            out.append(value)
        elif isinstance(value, list):
            out += [item for item in value if isinstance(item, ast.AST)]   # a dict's keys hold None
    return out


def walk(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk(node)`` less the tokens: ``node`` and everything under it, breadth first."""
    todo = deque([node])
    while todo:
        node = todo.popleft()
        todo.extend(child_nodes(node))
        yield node


def dotted_key(node: ast.expr) -> str | None:
    """``a.b.c`` for a name or attribute chain (``self.cfg.accum``), else None: how the rules name
    what an expression refers to.

    Example::

        dotted_key(ast.parse("self.cfg.accum", mode="eval").body)   # 'self.cfg.accum'
    """
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted_key(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None
