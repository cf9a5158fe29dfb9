"""The admin's Charts and Workers pages: the queues over time, and who holds what now.

Mixed into :class:`~queueapp.admin.pages.OpsPagesMixin` (its ``get_urls``
registers them behind ``admin_view``); both need the permission to view
outcomes, and both answer during a Redis outage with a banner instead of the
broker's part.

The charts are drawn in the browser by uPlot (MIT, vendored under
``static/queueapp/vendor/uplot/`` with its license: no CDN, works offline)
from the series of :mod:`queueapp.series`, embedded in the page as JSON.
"""

from __future__ import annotations

from django.core.exceptions import PermissionDenied
from django.db import DatabaseError
from django.utils.translation import gettext as _

from queueapp import conf, series
from queueapp.broker_reads import known_queues
from queueapp.errors import BrokerUnavailable
from queueapp.ops import workers


class MonitoringPagesMixin:
    """``charts_view`` and ``workers_view`` for the ``TaskOutcome`` admin."""

    def charts_view(self, request):
        if not self.has_view_permission(request):
            raise PermissionDenied
        window = request.GET.get("window", "hour")
        if window not in series.WINDOWS:
            window = "hour"
        queue = request.GET.get("queue") or None
        data, error, database_error = None, "", ""
        try:
            data = series.read_series(self.celery_app(), window, queue)
        except BrokerUnavailable as exc:
            error = str(exc)
            try:
                data = series.absorbed_from_database(window, queue)  # what the database alone knows
                data.queues = known_queues(self.celery_app())
            except DatabaseError as db_exc:
                database_error = f"{type(db_exc).__name__}: {db_exc}"
        return self._page(
            request,
            "charts.html",
            _("Charts"),
            series=data,
            chart_data=data.as_dict() if data is not None else None,
            window=window,
            windows=list(series.WINDOWS),
            queue=queue,
            queues=data.queues if data is not None else [],
            interval=conf.get("SERIES_INTERVAL"),
            broker_error=error,
            database_error=database_error,
        )

    def workers_view(self, request):
        if not self.has_view_permission(request):
            raise PermissionDenied
        report = workers.workers_report(self.celery_app())
        return self._page(
            request,
            "workers.html",
            _("Workers"),
            report=report,
            broker_error=report.broker_error,
            database_error=report.database_error,
            change_url_name=f"admin:{self.opts.app_label}_{self.opts.model_name}_change",
        )
