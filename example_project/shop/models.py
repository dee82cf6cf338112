"""The demo's observer: every task attempt writes its start and its end here, committed at once on Django's own
connection. It is independent of the ledger, so the demo checks the ledger's bounds against it."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


class Observation(models.Model):
    KINDS = (("start", "start"), ("end", "end"), ("fail", "failed"))

    kind = models.CharField(max_length=8, choices=KINDS)
    task_id = models.CharField(max_length=64, db_index=True)
    attempt = models.IntegerField(default=0, help_text="Celery's retries count: 0 for the first attempt")
    key = models.CharField(max_length=200, help_text="the key the task ran under (concurrency or group key)")
    label = models.CharField(max_length=200)
    worker = models.CharField(max_length=200)
    pid = models.IntegerField()
    at = models.DateTimeField(db_default=Now())

    class Meta:
        ordering = ("at", "id")

    def __str__(self) -> str:
        return f"{self.label} {self.kind} (attempt {self.attempt})"
