"""Functions peak binds to a user's object as instance attributes (amp's ``forward``, ``step``...)."""
from __future__ import annotations

import inspect
import types


def stands_in_for(target):
    """Mark a function to bind with :class:`BoundMethod` as standing in for ``target(obj)``, whose
    signature the bound method shows (``inspect.signature``)."""
    def mark(func):
        func.stands_in_for = target
        return func
    return mark


class BoundMethod:
    """``func`` bound to ``obj``: called, inspected and deep-copied as ``types.MethodType(func,
    obj)`` is, and it pickles (a bound method pickles as ``getattr(obj, func.__name__)``, which
    fails for a function that is not on the object's class: ``torch.save(model)`` wrote a file
    that did not load)."""

    # (__dict__: Dynamo guards on it; it stays empty, as a method takes no attributes)
    __slots__ = ("__func__", "__self__", "__weakref__", "__dict__", "_replaced")

    def __init__(self, func, obj, replaced=None) -> None:
        object.__setattr__(self, "__func__", func)
        object.__setattr__(self, "__self__", obj)
        object.__setattr__(self, "_replaced", replaced)  # (the method it stands in for)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"'method' object has no attribute '{name}'")

    def __call__(self, *args, **kwargs):
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        """The method's, or that of what it stands in for (``func.stands_in_for(obj)``)."""
        stand_in = getattr(self.__func__, "stands_in_for", None)
        try:
            return inspect.signature(stand_in(self.__self__))
        except (TypeError, ValueError):  # (none, or one without a signature: a builtin's)
            return inspect.signature(types.MethodType(self.__func__, self.__self__))

    __doc__ = property(lambda self: self.__func__.__doc__)  # (a class attribute otherwise)

    def __getattr__(self, name: str):  # (__name__, __wrapped__...: the function's)
        if name == "_wrapped_by_lr_sched":  # torch's LR scheduler marks the step it wrapped:
            return getattr(self._replaced, name)  # the step bound over that one calls it
        return getattr(self.__func__, name)

    def __repr__(self) -> str:
        return f"<bound method {self.__func__.__qualname__} of {self.__self__!r}>"

    def __reduce__(self):
        return type(self), (self.__func__, self.__self__)
