"""Keys computed at publish from a call's arguments (no broker, no database)."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_keyed import keyed_task
from celery_keyed.ledger import InvalidKey
from celery_keyed.task import HEADER_GROUP, HEADER_KEY, evaluate_key


@pytest.fixture
def app() -> Celery:
    return Celery("unit", set_as_current=False)


def test_template_over_bound_arguments_with_defaults(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="account:{account_id}", group_key="order:{order}")
    def sync(account_id: int, order: str = "none") -> None: ...

    assert sync.keyed_headers((7,), {}) == {HEADER_KEY: "account:7", HEADER_GROUP: "order:none"}
    assert sync.keyed_headers((), {"account_id": 8, "order": "x"}) == {HEADER_KEY: "account:8", HEADER_GROUP: "order:x"}


def test_callable_and_tuple_keys(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key=lambda tenant_id, **_: ("stripe", tenant_id))
    def charge(tenant_id: int, amount: int) -> None: ...

    assert charge.keyed_headers((3, 10), {}) == {HEADER_KEY: "stripe:3"}


def test_per_call_key_wins_and_none_means_unkeyed(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="account:{account_id}")
    def sync(account_id: int) -> None: ...

    assert sync.keyed_headers((7,), {}, {"concurrency_key": "account:7-override"}) == {HEADER_KEY: "account:7-override"}
    assert sync.keyed_headers((7,), {}, {"concurrency_key": None}) == {}


def test_whole_field_template_keeps_the_arguments_type(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="{key}")
    def run(key: object) -> None: ...

    assert run.keyed_headers((("api", 3),), {}) == {HEADER_KEY: "api:3"}
    with pytest.raises(InvalidKey, match="must be a str or a"):
        run.keyed_headers((["a"],), {})


def test_template_naming_a_missing_argument_is_a_clear_error(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key="account:{acount_id}")
    def sync(account_id: int) -> None: ...

    with pytest.raises(InvalidKey, match="acount_id"):
        sync.keyed_headers((7,), {})


def test_bad_key_from_a_callable(app: Celery) -> None:
    @keyed_task(app=app, concurrency_key=lambda x: 12)
    def f(x: int) -> None: ...

    with pytest.raises(InvalidKey, match="must be a str"):
        f.keyed_headers((1,), {})


def test_unkeyed_spec() -> None:
    assert evaluate_key(None, object(), (), {}) is None


def test_keyed_task_accepts_every_task_option(app: Celery) -> None:
    @keyed_task(app=app, bind=True, max_retries=5, acks_late=True, name="x.y", concurrency_key="k:{a}")
    def t(self, a: int) -> int:
        return a

    assert t.name == "x.y" and t.max_retries == 5 and t.acks_late
    assert t.concurrency_key == "k:{a}"


def test_keyed_task_with_app_registers_on_that_app_only() -> None:
    one, other = Celery("one", set_as_current=False), Celery("other", set_as_current=False)

    @keyed_task(app=one, name="only.here", concurrency_key="k:{a}")
    def t(a: int) -> None: ...

    assert "only.here" in one.tasks
    assert "only.here" not in other.tasks


def test_app_task_with_base_keyedtask_is_keyed_like_keyed_task() -> None:
    """``@app.task(base=KeyedTask, concurrency_key=...)``, the alternative docs/guide.md shows."""
    from celery import Celery

    from celery_keyed import KeyedTask

    app = Celery("base-keyedtask", broker="memory://", set_as_current=False)

    @app.task(base=KeyedTask, concurrency_key="account:{account_id}")
    def sync(account_id: int) -> None: ...

    @app.task(base=KeyedTask, concurrency_key=lambda tenant_id, **_: ("stripe", tenant_id))
    def charge(tenant_id: int, amount: int) -> None: ...

    assert sync.keyed_headers((7,), {}) == {"keyed_key": "account:7"}
    assert charge.keyed_headers((3, 10), {}) == {"keyed_key": "stripe:3"}
