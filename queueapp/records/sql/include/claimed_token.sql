-- The token a claim takes: the broker's, if above the stored one; else the stored one plus one
-- (a retry behind a higher broker token, or no broker token). It only ever grows.
-- Parameters: token.
CASE WHEN %(token)s > fence_token THEN %(token)s ELSE fence_token + 1 END
