"""Every message header of the gate, and what survives a retry or a copy. Imports nothing of celery-keyed, so
the producer side (task.py), the stored messages (messages.py) and the worker (worker/intake.py) share it
without importing each other.

A keyed call carries its keys at the top level of the message headers (Celery hands them to ``task.request``);
a worker that gets a message without them (``send_task`` from a foreign producer) computes them from the
arguments again.
"""

from __future__ import annotations

#: The concurrency key (a string) or keys (a list, claimed all-or-nothing).
HEADER_KEY = "keyed_key"
#: The group key (ordered stream per group).
HEADER_GROUP = "keyed_group"
#: The group sequence number allocated at publish (D10).
HEADER_GROUP_SEQ = "keyed_group_seq"
#: The supersede key (overflow policy ``supersede``).
HEADER_SUPERSEDE = "keyed_supersede"
#: A promotion's admission token (D5): never survives a retry or a copy.
HEADER_NONCE = "keyed_nonce"
#: Slots the attempt takes of each of its keys (sent only when not 1).
HEADER_COST = "keyed_cost"
#: Whose share of a ``fair`` name's slots the call uses.
HEADER_FAIR = "keyed_fair"
#: The weight of that fair key as the call gives it (``fair_weight``; weighted fair sharing).
HEADER_FAIR_WEIGHT = "keyed_fair_weight"
#: ``concurrency_mode``: "exclusive" (runs alone on its key) or "shared" (sent only when either is not the default).
HEADER_MODE = "keyed_mode"
#: The attempt's fence number, set by the worker in the request it runs (``self.request.keyed_fence``, D7); Celery
#: copies request fields into a retry's headers, so it is stripped there like the nonce.
HEADER_FENCE = "keyed_fence"
#: Debounce: ``[seconds, max_seconds, keep]`` of a debounced call, from the call's, the task's or
#: the name's options. Never survives a retry or a copy: a retry of a debounced task is not debounced again.
HEADER_DEBOUNCE = "keyed_debounce"
#: Newest wins: ``"cancel_running"`` when a newer call of the same key and supersede key cancels the
#: running one (``on_newer``; sent only then). A retry keeps it, so that its claim can be cancelled too.
HEADER_ON_NEWER = "keyed_on_newer"
#: The limit of the first concurrency key as the call computed it (``concurrency_limit``; sent only when the task
#: declares one or the call names one).
HEADER_LIMIT = "keyed_limit"

GATE_HEADERS = (
    HEADER_KEY, HEADER_GROUP, HEADER_GROUP_SEQ, HEADER_SUPERSEDE, HEADER_NONCE, HEADER_COST, HEADER_FAIR, HEADER_MODE,
    HEADER_FAIR_WEIGHT, HEADER_ON_NEWER, HEADER_LIMIT,
)

#: Never survive a retry or a copy: an admission token and a fence belong to one attempt.
NOT_INHERITED = (HEADER_NONCE, HEADER_FENCE, HEADER_DEBOUNCE)

#: What a retry or a copy keeps from the headers it was sent with, unless the call names new keys.
INHERITED = (
    HEADER_KEY, HEADER_GROUP, HEADER_SUPERSEDE, HEADER_GROUP_SEQ, HEADER_COST, HEADER_FAIR, HEADER_MODE,
    HEADER_FAIR_WEIGHT, HEADER_ON_NEWER, HEADER_LIMIT,
)

#: The task option (class attribute or ``apply_async`` keyword) each header is computed from, in the order the
#: producer computes them. ``keyed_group_seq`` has no option: it is allocated at publish.
OPTION_OF_HEADER = {
    HEADER_KEY: "concurrency_key",
    HEADER_GROUP: "group_key",
    HEADER_SUPERSEDE: "supersede_key",
    HEADER_COST: "concurrency_cost",
    HEADER_FAIR: "fair_key",
    HEADER_MODE: "concurrency_mode",
    HEADER_FAIR_WEIGHT: "fair_weight",
    HEADER_ON_NEWER: "on_newer",
    HEADER_LIMIT: "concurrency_limit",
}
