"""``manage.py diagnose KEY``: why a key was delivered more than once, one sentence per extra delivery."""

from __future__ import annotations

import json

from celery import current_app
from django.core.management.base import BaseCommand, CommandError

from queueapp import conf
from queueapp.models import TaskOutcome
from queueapp.ops.diagnosis import Diagnosis, diagnose_outcomes


class Command(BaseCommand):
    help = (
        "Explain every extra delivery of an idempotency key from the records: the delivery log in the "
        "database, the operators' actions, and the broker's reclaim and dedup logs (lease expired and "
        "when its worker last extended it, publish deduplicated, Celery retry, requeued by whom, stale "
        "token refused, ack lost, deferred). When Redis cannot be read, says what the database knows."
    )

    def add_arguments(self, parser) -> None:
        parser.add_argument("key", nargs="+", help="idempotency key (several allowed)")
        parser.add_argument("--json", action="store_true", dest="as_json", help="print the diagnosis as JSON")

    def handle(self, *args, key: list[str], as_json: bool, **options) -> None:
        outcomes = {
            o.idempotency_key: o
            for o in TaskOutcome.objects.using(conf.get("DATABASE")).filter(idempotency_key__in=key)
        }
        missing = [k for k in key if k not in outcomes]
        if missing:
            raise CommandError(f"no outcome recorded for {', '.join(missing)}")
        found = diagnose_outcomes(current_app._get_current_object(), outcomes.values())
        diagnoses = [found[outcomes[k].pk] for k in key]
        if as_json:
            self.stdout.write(json.dumps([d.as_dict() for d in diagnoses]))
            return
        for diagnosis in diagnoses:
            write_diagnosis(self.stdout, diagnosis)


def write_diagnosis(out, diagnosis: Diagnosis, indent: str = "") -> None:
    """The diagnosis as text: a summary line, then one line per extra delivery (also used by requeue)."""
    out.write(f"{indent}{diagnosis.summary}")
    if diagnosis.broker_error:
        out.write(f"{indent}  broker not read: {diagnosis.broker_error}")
    if not diagnosis.findings:
        out.write(f"{indent}  no extra delivery: nothing to explain")
    for finding in diagnosis.findings:
        out.write(f"{indent}  - {finding.sentence}")
