"""Arguments declared once: a class's annotated attributes are its keyword arguments, checked and read-only.

A subclass of :class:`Declared` lists its arguments as annotated class attributes whose values are
:func:`argument` declarations (default, one line of documentation, the check of a value). From that one
declaration come the keyword-only ``__init__`` (its signature is what jsonargparse and LightningCLI read, and what
type checkers see, through ``dataclass_transform``), the validation of every value where the object is built, the
``Args:`` section of the class docstring and the reference table of ``docs/reference.md``. Once built, a declared
argument cannot be set: ``cb.action = "explode"`` raises ``AttributeError`` naming the argument.

Arguments renamed into a group keep their old flat name as a :func:`moved` declaration: accepted (with a
``DeprecationWarning`` naming the new place) and mapped into the group.

Example:
    >>> class Limits(Declared):
    ...     low: int = argument(0, "the smallest value", check=lambda name, v: v)
    >>> Limits(low=3).low
    3
    >>> Limits(low=3).low = 4
    Traceback (most recent call last):
    ...
    AttributeError: Limits.low is read-only once built: build a new Limits(low=...) instead
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from typing_extensions import dataclass_transform

__all__ = ["Argument", "Declared", "argument", "moved"]

_MISSING: Any = dataclasses.MISSING


@dataclass(frozen=True)
class Argument:
    """One declared argument: its default (or a factory of it), its documentation, and the check of a value.

    ``check(name, value)`` raises :class:`~lightning_numguard.errors.NumGuardConfigError` naming the argument, the
    allowed values and the value received, and returns the value to store (a plain ``int`` for a restricted one).
    ``moved_to`` (``"group.field"``): a flat name kept from before the groups (deprecated; mapped there).
    """

    default: Any = _MISSING
    doc: str = ""
    check: Callable[[str, Any], Any] | None = None
    factory: Callable[[], Any] | None = None
    moved_to: str | None = None
    name: str = ""
    annotation: Any = None

    def default_value(self) -> Any:
        return self.factory() if self.factory is not None else self.default


def argument(
    default: Any = _MISSING,
    doc: str = "",
    *,
    check: Callable[[str, Any], Any] | None = None,
    factory: Callable[[], Any] | None = None,
) -> Any:
    """Declare an argument (typed as its annotation for type checkers; see :class:`Argument`)."""
    return Argument(default=default, doc=doc, check=check, factory=factory)


def moved(to: str, default: None = None) -> Any:
    """Declare an old flat name of an argument that moved into a group (``"spikes.sigma"``): accepted and mapped,
    with a ``DeprecationWarning``; ``None`` (its default) means not given. Read, it gives the group's value."""
    return Argument(
        default=default, doc=f"deprecated, accepted and mapped with a DeprecationWarning: use ``{to}``", moved_to=to
    )


@dataclass_transform(kw_only_default=True, field_specifiers=(argument, moved, field))
class Declared:
    """The base of classes whose arguments are their annotated :func:`argument` attributes (see the module)."""

    #: every declared argument of the class, its bases' first, in declaration order
    __arguments__: ClassVar[dict[str, Argument]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared: dict[str, Argument] = dict(getattr(cls, "__arguments__", {}))
        own = {n: v for n, v in vars(cls).items() if isinstance(v, Argument)}
        if own:  # resolved where they were written (``from __future__ import annotations`` makes them strings)
            hints = typing.get_type_hints(cls, include_extras=True)
            for name, value in own.items():
                declared[name] = dataclasses.replace(value, name=name, annotation=hints[name])
        for name in declared:
            if name in vars(cls) and isinstance(vars(cls)[name], Argument):
                delattr(cls, name)  # read from the instance (``__dict__``), never the declaration
        cls.__arguments__ = declared
        if "__init__" not in vars(cls):
            cls.__init__ = _init_of(cls, declared)  # type: ignore[method-assign]

    def __setattr__(self, name: str, value: Any) -> None:
        if name in type(self).__arguments__ and name in self.__dict__:
            owner = type(self).__name__
            raise AttributeError(f"{owner}.{name} is read-only once built: build a new {owner}({name}=...) instead")
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        arg = type(self).__arguments__.get(name)
        if arg is None or arg.moved_to is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        group, _, part = arg.moved_to.partition(".")
        _say_moved(type(self).__name__, name, arg.moved_to)
        return getattr(getattr(self, group), part)

    def arguments(self) -> dict[str, Any]:
        """The declared arguments and their values as built (the moved flat names left out)."""
        return {n: getattr(self, n) for n, a in type(self).__arguments__.items() if a.moved_to is None}


def _declare(self: Declared, values: dict[str, Any]) -> None:
    """Check, map and store ``values`` (the declared arguments given to ``__init__``) on ``self``."""
    arguments = type(self).__arguments__
    unknown = sorted(set(values) - set(arguments))
    if unknown:
        raise TypeError(f"{type(self).__name__}() got unexpected keyword argument(s) {unknown}")
    given = {name: value for name, value in values.items() if not arguments[name].moved_to or value is not None}
    moves: dict[str, dict[str, Any]] = {}
    for name, arg in arguments.items():
        if arg.moved_to is not None:
            if name in given:
                group, _, part = arg.moved_to.partition(".")
                moves.setdefault(group, {})[part] = given[name]
                _say_moved(type(self).__name__, name, arg.moved_to)
            continue
        value = given[name] if name in given else arg.default_value()
        if arg.check is not None:
            value = arg.check(name, value)
        object.__setattr__(self, name, value)
    for group, parts in moves.items():  # the old flat names, into their groups
        current = getattr(self, group)
        object.__setattr__(self, group, dataclasses.replace(current, **parts))


def _say_moved(owner: str, name: str, to: str) -> None:
    from lightning_numguard.reporting.report import warn_at_user_code  # the user's line, not this package's

    group, _, part = to.partition(".")
    warn_at_user_code(
        f"{owner}({name}=...) is deprecated: the argument moved into the `{group}` group as `{to}`; write "
        f"{owner}({group}={{'{part}': ...}}) in Python, or `{group}:` with `{part}:` under it in YAML",
        DeprecationWarning,
    )


def _init_of(cls: type, declared: dict[str, Argument]) -> Callable[..., None]:
    """A keyword-only ``__init__`` with one parameter per declared argument (its annotation and default)."""

    def __init__(self: Any, /, **values: Any) -> None:
        _declare(self, values)
        post = getattr(self, "__post_init__", None)
        if callable(post):
            post()

    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)]
    for name, arg in declared.items():
        default = None if arg.default is _MISSING and arg.factory is not None else arg.default
        if arg.factory is not None:
            default = arg.factory()
        kind = inspect.Parameter.KEYWORD_ONLY
        parameters.append(inspect.Parameter(name, kind, default=default, annotation=arg.annotation))
    __init__.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    __init__.__annotations__ = {a.name: a.annotation for a in declared.values()}
    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    __init__.__module__ = cls.__module__
    return __init__
