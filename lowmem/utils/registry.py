"""How every kind of the project registers: defining its class.

A capability with several implementations (a precision, a frozen form, an engine, an objective, a tracker, a metric)
is a family: one root class marked ``family=True``, one subclass per kind, each with a ``name`` of its own. Defining
the subclass adds it to the root's ``kinds`` (``{name: class}``, in the order they are defined); the root joins too
when it names itself (the plain engine's behaviour, float32's precision). A class without a ``name`` of its own (a
shared base of kinds) joins nothing. Code elsewhere looks a kind up by the name a flag or a file gives, then asks
the class; it never compares the name.

    class Precision(Registered, family=True):
        name = "no"

    class BFloat16(Precision):
        name = "bf16"

    Precision.kinds  # {"no": Precision, "bf16": BFloat16}
"""

from __future__ import annotations

from typing import ClassVar


class Registered:
    """The root of a family of kinds registers its subclasses by their ``name`` (see the module's docstring)."""

    name: ClassVar[str] = ""
    kinds: ClassVar[dict[str, type]]  # the family's kinds by name, filled as their classes are defined

    def __init_subclass__(cls, family: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if family:
            cls.kinds = {}
        name = cls.__dict__.get("name")
        if not name:
            return
        known = cls.kinds.get(name)
        # The same class defined again (its module imported a second time, as a test's reload does) replaces itself
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"two kinds are named {name!r}: {known.__module__}.{known.__qualname__} and "
                            f"{cls.__module__}.{cls.__qualname__}")
        cls.kinds[name] = cls
