"""Date formats of the admin in English: every timestamp shows its seconds (operators compare them)."""

DATETIME_FORMAT = "Y-m-d H:i:s"
SHORT_DATETIME_FORMAT = "Y-m-d H:i:s"
TIME_FORMAT = "H:i:s"
DATE_FORMAT = "Y-m-d"
