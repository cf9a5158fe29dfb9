"""queueapp: exactly-once task effects for Celery on the fenced:// Redis transport."""
