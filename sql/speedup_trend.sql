-- Question: do the predicted speedups hold when measured live, run after run (per domain)?
-- Reads: live_measurements (measured speedup and the prediction it was checked against) and
--   acceptance_estimates (the prediction's 95% interval for the same run, domain, drafter and K).
-- Columns: measured_over_predicted < 1 means the planner was optimistic; within_ci95 is 1 when
--   the measured speedup lies inside the predicted interval (NULL when there is no interval).
SELECT date(m.created_at) AS day, m.run_id, m.domain, m.drafter, m.k, m.batch_size, m.requests,
       COALESCE(m.predicted_speedup, e.predicted_speedup) AS predicted_speedup,
       e.predicted_speedup_lo AS predicted_ci95_lo,
       e.predicted_speedup_hi AS predicted_ci95_hi,
       m.measured_speedup,
       m.measured_speedup / NULLIF(COALESCE(m.predicted_speedup, e.predicted_speedup), 0)
           AS measured_over_predicted,
       CASE WHEN e.predicted_speedup_lo IS NULL OR e.predicted_speedup_hi IS NULL
                 OR m.measured_speedup IS NULL THEN NULL
            WHEN m.measured_speedup BETWEEN e.predicted_speedup_lo AND e.predicted_speedup_hi THEN 1
            ELSE 0 END AS within_ci95
FROM live_measurements m
LEFT JOIN acceptance_estimates e
       ON e.run_id = m.run_id AND e.domain = m.domain AND e.drafter = m.drafter AND e.k = m.k
ORDER BY m.created_at, m.domain, m.drafter, m.k, m.batch_size;
