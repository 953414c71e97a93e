"""Old keyword names of transfer callables that keep working for one release, with a ``DeprecationWarning``."""

from __future__ import annotations

import functools

from dtkv._util import warn_deprecated

__all__ = ["renamed_kwargs"]


def renamed_kwargs(cls_or_fn, owner: str, **renames: str):
    """Wrap a callable (or a class's ``__init__``) so that each old keyword of ``renames`` (old=new) still works."""
    target = cls_or_fn.__init__ if isinstance(cls_or_fn, type) else cls_or_fn

    @functools.wraps(target)
    def wrapper(*args, **kwargs):
        for old, new in renames.items():
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{owner} got both {old}= and its new name {new}=")
                warn_deprecated(f"{owner}({old}=...)", f"{new}=", stacklevel=3)
                kwargs[new] = kwargs.pop(old)
        return target(*args, **kwargs)

    if isinstance(cls_or_fn, type):
        cls_or_fn.__init__ = wrapper
        return cls_or_fn
    return wrapper
