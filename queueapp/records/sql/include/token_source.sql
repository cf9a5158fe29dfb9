-- Where a delivery's token comes from: the broker (fenced://), or the database's counter.
-- Parameters: token.
CASE WHEN CAST(%(token)s AS BIGINT) IS NULL THEN 'database' ELSE 'broker' END
