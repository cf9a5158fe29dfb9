"""Django settings: embedded defaults (SQLite, local Redis), overridden by environment variables.

``REDIS_URL``     the Redis server for broker and cache (default ``redis://127.0.0.1:6379/0``).
``BROKER_URL``    the Celery broker; default: ``fenced://`` on the same Redis.
``DATABASE_URL``  any dj-database-url URL; default: SQLite file ``var/db.sqlite3``.
``QUEUEAPP_RECORD_RUNNING``  ``1``: queueapp's ``RECORD_RUNNING`` (claims committed before bodies).
"""

import os
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("QUEUEAPP_VAR_DIR", BASE_DIR / "var"))

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "dev-only-insecure-key-change-me")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "queueapp",
    "lab",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "settings.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "settings.wsgi.application"

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL", f"sqlite:///{VAR_DIR / 'db.sqlite3'}"),
        # Persistent connections: a worker reuses its connection across tasks (a new one per task
        # costs more than the task's own queries); the health check replaces one that died.
        conn_max_age=int(os.environ.get("DATABASE_CONN_MAX_AGE", "600")),
        conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several worker processes write to one SQLite file: wait for the lock instead of failing.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {"timeout": 30, "transaction_mode": "IMMEDIATE", "init_command": "PRAGMA journal_mode=WAL;"}
    )
elif "postgresql" in DATABASES["default"]["ENGINE"]:
    # A database host that stops answering: give up connecting after 5 s (queueapp.W008), unless
    # the URL says otherwise (?connect_timeout=N).
    DATABASES["default"].setdefault("OPTIONS", {}).setdefault("connect_timeout", 5)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_PASSWORD_VALIDATORS = []
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
# Timestamps with seconds everywhere in the admin (settings/formats/en/formats.py).
FORMAT_MODULE_PATH = ["settings.formats"]
STATIC_URL = "static/"

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
_redis = urlsplit(REDIS_URL)
_fenced_scheme = "fenceds" if _redis.scheme == "rediss" else "fenced"

# Celery: everything the worker reads, under the CELERY_ namespace.
CELERY_BROKER_URL = os.environ.get("BROKER_URL", _redis._replace(scheme=_fenced_scheme).geturl())
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "lease_timeout": float(os.environ.get("FENCED_LEASE_TIMEOUT", "30")),
    "max_deliveries": int(os.environ.get("FENCED_MAX_DELIVERIES", "5")),
}
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# Dead-letters undecodable messages instead of dropping them; running tasks keep their leases on a reconnect.
CELERY_WORKER_CONSUMER = "broker_ext.worker:Consumer"
CELERY_WORKER_PREFETCH_MULTIPLIER = 4
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery's Django fixup closes the database connections around every task unless this is set
# (then every N tasks); queueapp closes them at task boundaries by Django's own rule instead
# (CONN_MAX_AGE, errors, CONN_HEALTH_CHECKS): see docs/benchmarks.md.
CELERY_DB_REUSE_MAX = int(os.environ.get("CELERY_DB_REUSE_MAX", "100000"))

# queueapp's settings: every key and its default in queueapp/conf.py.
QUEUEAPP = {"RECORD_RUNNING": os.environ.get("QUEUEAPP_RECORD_RUNNING") == "1"}

# django-redis: the project's cache, on the same Redis as the broker.
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "queueapp",
        "OPTIONS": {
            "SOCKET_CONNECT_TIMEOUT": 1,
            "SOCKET_TIMEOUT": 1,
            # A cache outage must change speed only, never correctness.
            "IGNORE_EXCEPTIONS": True,
            # django-redis pickles by default; nothing here is ever pickled.
            "SERIALIZER": "django_redis.serializers.json.JSONSerializer",
        },
    }
}
DJANGO_REDIS_IGNORE_EXCEPTIONS = True
DJANGO_REDIS_LOG_IGNORED_EXCEPTIONS = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"broker_ext": {"handlers": ["console"], "level": "WARNING"}},
}
