-- Question: why were imported traffic rows rejected, how many, and where is the first example?
-- Reads: quarantined_requests (one row per rejected line: file, line number, reason), open entries
--   only: an entry that a later complete import of the same file superseded (garbled lines of a
--   corrupt gzip, superseded_at set) is not counted.
-- first_example is FILE:LINE of the earliest stored rejection with that reason; example_request_id
--   is a request id seen with that reason (NULL when the row had no readable id).
SELECT q.reason,
       COUNT(*) AS rows_rejected,
       COUNT(DISTINCT q.source_file) AS files,
       MIN(q.imported_at) AS first_seen,
       MAX(q.imported_at) AS last_seen,
       (SELECT q2.source_file || ':' || CAST(q2.line_number AS TEXT)
        FROM quarantined_requests q2
        WHERE q2.reason = q.reason AND q2.superseded_at IS NULL
        ORDER BY q2.id
        LIMIT 1) AS first_example,
       MIN(q.request_id) AS example_request_id
FROM quarantined_requests q
WHERE q.superseded_at IS NULL
GROUP BY q.reason
ORDER BY COUNT(*) DESC, q.reason;
