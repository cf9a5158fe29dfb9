"""``@exactly_once``: the commit rule around a Celery task, in either decorator order.

Over the task (the documented order)::

    @exactly_once(key=lambda order_id: f"charge:{order_id}")
    @shared_task(bind=True)
    def charge(self, order_id): ...

or under it (``@shared_task`` then builds the task from the wrapped function)::

    @shared_task(bind=True)
    @exactly_once
    def charge(self, order_id): ...

Both install the same wrapper at the innermost call of the task, so the body
and Celery's ``autoretry_for`` behave the same way. Over a task, the wrapper
is installed when the Celery app finalizes (``shared_task`` hands back a lazy
proxy), or at once if it already has.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

from celery import Task
from celery._state import _get_active_apps, connect_on_app_finalize, get_current_task
from celery.local import PromiseProxy, Proxy

from queueapp.delivery import current_delivery
from queueapp.errors import ConfigurationError, IdempotencyKeyError

logger = logging.getLogger(__name__)

POLICY_ATTRIBUTE = "_exactly_once_policy"
MAX_KEY_LENGTH = 255


@dataclass(frozen=True)
class ExactlyOncePolicy:
    """How one task is made exactly-once: its key function and publish options."""

    key: Callable[..., str] | None = None
    dedup_window: float | None = None
    queue: str | None = None

    def key_for(self, args: tuple | list, kwargs: dict, task_id: str | None) -> str:
        """The idempotency key of a call: the key function's value, else the Celery task id."""
        if self.key is None:
            value = task_id
        else:
            try:
                value = self.key(*args, **kwargs)
            except Exception as exc:
                raise IdempotencyKeyError(
                    f"key function failed for args={args!r} kwargs={kwargs!r}: {exc!r}"
                ) from exc
        if not isinstance(value, str) or not value or len(value) > MAX_KEY_LENGTH:
            raise IdempotencyKeyError(
                f"an idempotency key must be a non-empty str of at most {MAX_KEY_LENGTH} characters, "
                f"got {value!r}"
            )
        return value


def policy_of(task) -> ExactlyOncePolicy | None:
    """The policy of an exactly-once task (either decorator order), or ``None``."""
    policy = getattr(task, POLICY_ATTRIBUTE, None)
    if policy is None:
        policy = getattr(getattr(task, "run", None), POLICY_ATTRIBUTE, None)
    return policy


def _context_attribute(name: str) -> property:
    def read(self) -> Any:
        context = current_delivery()
        return getattr(context, name) if context is not None else None

    return property(read, doc=f"This delivery's {name} (``None`` outside an exactly-once run).")


def _install_accessors(task_class: type) -> None:
    """Give the task ``self.idempotency_key`` and ``self.fence_token`` (the running delivery's)."""
    if "idempotency_key" not in vars(task_class):
        task_class.idempotency_key = _context_attribute("key")
    if "fence_token" not in vars(task_class):
        task_class.fence_token = _context_attribute("token")


def _run(task, policy: ExactlyOncePolicy, body: Callable[[], Any], args: tuple, kwargs: dict) -> Any:
    request = task.request  # A lookup in Celery's request stack: read once per delivery.
    if request.called_directly:
        # Called as a plain function (``task(...)``): no delivery, nothing to deduplicate. A message
        # whose id is missing is a delivery all the same, and is refused as such.
        return body()
    from queueapp import execution  # Needs the models: imported once the apps are ready.

    return execution.run(task, policy, body, args, kwargs, request=request)


def _wrap_function(fun: Callable, policy: ExactlyOncePolicy) -> Callable:
    """Wrap a plain function that ``@shared_task`` / ``@app.task`` will turn into a task."""
    if policy.queue is not None:
        raise ConfigurationError("under @shared_task, pass queue= to @shared_task, not to @exactly_once")

    @functools.wraps(fun)
    def run(*args, **kwargs):
        task = get_current_task()
        if task is None:
            return fun(*args, **kwargs)
        _install_accessors(type(task))
        call_args = args[1:] if args and args[0] is task else args  # bind=True passes the task first
        return _run(task, policy, lambda: fun(*args, **kwargs), call_args, kwargs)

    setattr(run, POLICY_ATTRIBUTE, policy)
    return run


def ack_only_with_a_verdict(task: Task) -> None:
    """Make the worker keep every delivery of ``task`` in the broker unless its key has a verdict.

    Whatever returns or raises from the task itself is already safe to ack (see
    :mod:`queueapp.execution`). What the task never sees is decided by
    the worker's main process: an early ack (``acks_late`` off) would drop the
    message before it ran, a hard time limit is acked by default
    (``task_acks_on_failure_or_timeout``), and a pool process that died is
    acked unless ``task_reject_on_worker_lost``. All three give the message
    back instead, for every exactly-once task, whatever the project's settings.
    """
    task.acks_late = True
    task.acks_on_timeout = False
    task.reject_on_worker_lost = True


def install(task: Task, policy: ExactlyOncePolicy) -> Task:
    """Install the commit rule on a task object (idempotent)."""
    if getattr(task, POLICY_ATTRIBUTE, None) is not None:
        return task
    ack_only_with_a_verdict(task)
    # With autoretry_for, Celery has already wrapped run; the original is _orig_run.
    attribute = "_orig_run" if "_orig_run" in vars(task) else "run"
    original = getattr(task, attribute)

    @functools.wraps(original)
    def run(*args, **kwargs):
        return _run(task, policy, lambda: original(*args, **kwargs), args, kwargs)

    setattr(task, attribute, run)
    setattr(task, POLICY_ATTRIBUTE, policy)
    if policy.queue is not None:
        task.queue = policy.queue
        task._exec_options = None
    _install_accessors(type(task))
    return task


def _install_on_proxy(proxy: Proxy, policy: ExactlyOncePolicy) -> Proxy:
    """Install on the task a lazy proxy stands for, as soon as the task exists."""
    if isinstance(proxy, PromiseProxy):  # @app.task on an app not finalized yet
        proxy.__then__(lambda: install(proxy._get_current_object(), policy))
        return proxy

    def install_from_proxy(**_: Any) -> None:
        try:
            install(proxy._get_current_object(), policy)
        except KeyError:  # This app does not have the task: nothing to install.
            logger.debug("exactly_once: task of %r not registered with the current app", proxy)

    # @shared_task: its task is created when an app finalizes; install right after.
    connect_on_app_finalize(lambda app: app.on_after_finalize.connect(install_from_proxy, weak=False))
    if any(app.finalized for app in _get_active_apps()):
        install_from_proxy()
    return proxy


@overload
def exactly_once(target: Callable, /) -> Any: ...
@overload
def exactly_once(
    *, key: Callable[..., str] | None = None, dedup_window: float | None = None, queue: str | None = None
) -> Callable[[Any], Any]: ...


def exactly_once(
    target: Any = None,
    /,
    *,
    key: Callable[..., str] | None = None,
    dedup_window: float | None = None,
    queue: str | None = None,
):
    """Make a Celery task's effects exactly-once: at most one committed success per idempotency key.

    ``key`` maps the task's arguments (without ``self``) to the idempotency key;
    the default is the Celery task id, so only redeliveries and retries of one
    publish are the same operation. With a key, two publishes of the same
    logical operation (two ``.delay(order_id=7)``) are one as well.

    ``dedup_window`` (seconds, needs a key) also asks the fenced:// transport to
    drop a second publish of the same key within the window, before it costs a
    delivery; correctness does not depend on it. ``queue`` sets the task's
    default queue (only over a task; under ``@shared_task`` pass it there).
    """
    if dedup_window is not None and key is None:
        raise ConfigurationError(
            "dedup_window needs a key function: the task id is unique per publish anyway"
        )
    policy = ExactlyOncePolicy(key=key, dedup_window=dedup_window, queue=queue)

    def decorate(obj: Any) -> Any:
        if isinstance(obj, Proxy):
            return _install_on_proxy(obj, policy)
        if isinstance(obj, Task):
            return install(obj, policy)
        if callable(obj):
            return _wrap_function(obj, policy)
        raise ConfigurationError(f"@exactly_once decorates a task or a function, not {obj!r}")

    return decorate(target) if target is not None else decorate
