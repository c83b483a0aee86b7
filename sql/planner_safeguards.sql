-- Question: which decisions did the planner's safeguards hold back, and why?
--   A run whose own cost profile was too noisy turns no domain on that the champion has off
--   ("noisy profile"); a domain planned on whose live check measured it too slow stays off
--   ("live veto"). One row per domain of every run, newest first.
-- Reads: domain_configs, eval_runs, cost_profile_checks (the profile a run measured itself or
--   reused, copied under its run id; a run planned with a named stored profile shows no profile
--   status), live_measurements.
-- Columns: profile_status ok | noisy (profile_measurements: how often it was measured before it
--   was stored; profile_max_spread: its largest interquartile range over the median;
--   profile_reused_from: the run that measured a reused profile, NULL where the run measured it;
--   profile_measured_at: when it was measured);
--   held_off_by: noisy profile | live veto | NULL; measured_lo / measured_hi: the live speedup's
--   95% interval over the confirm requests (how weak the evidence is: see requests).
-- Interrupted runs (eval_runs.status 'interrupted': stopped by a signal or a crash before they
--   finished) are left out: their plans are provisional.
SELECT d.run_id, d.domain, e.hardware_profile, c.status AS profile_status,
       c.attempts AS profile_measurements, c.max_spread AS profile_max_spread,
       c.reused_from AS profile_reused_from, c.measured_at AS profile_measured_at,
       CASE WHEN d.reason LIKE 'off: cost profile too noisy%' THEN 'noisy profile'
            WHEN d.reason LIKE 'live check:%' THEN 'live veto' END AS held_off_by,
       CASE WHEN d.enabled THEN 1 ELSE 0 END AS enabled,
       d.drafter, d.k, d.predicted_speedup, d.measured_speedup,
       l.measured_speedup_lo AS measured_lo, l.measured_speedup_hi AS measured_hi, l.requests,
       d.reason
FROM domain_configs d
JOIN eval_runs e ON e.run_id = d.run_id
LEFT JOIN cost_profile_checks c ON c.run_id = d.run_id AND c.hardware_profile = e.hardware_profile
LEFT JOIN live_measurements l ON l.run_id = d.run_id AND l.domain = d.domain
WHERE e.status <> 'interrupted'
ORDER BY d.created_at DESC, d.domain;
