-- Question: does speculation on vLLM change what users receive, per run and domain, beside our own engine's test?
--   One row per run and domain that had the sampling test on vLLM's OpenAI server (the engine
--   check's, tasks/steps/checks/engine_validate.py), newest first, beside the same run and domain's
--   sampling test on our engine (own_*: NULL where it did not run).
-- Reads: validations (check_name 'engine_sampling' and 'sampling'), domain_configs.
-- Columns: engine 'vllm'; passed 1 | 0 (0: failed, engine_differs or error; where a serving
--   environment exists this verdict gates promotion and the own engine's is reported only);
--   tested 1 when the server drew the rows and the G-tests ran, 0 when it could not run (status
--   error); smallest_p: the smallest p over the position tests, statistic: that test's G;
--   request_id: the request whose context was tested; validation / promotable / enabled: the
--   domain in the run's config after the gates.
-- Plain columns only: the rows per test, the number of position tests, the verdict (passed |
--   failed | engine_differs | error), the plain server's control and the reason are in
--   validations.details (JSON), which the reports in sql/ do not read (they use no JSON functions,
--   to stay portable); `specdec evaluate`'s table ("vLLM sampling") and the version page show them.
SELECT v.created_at AS checked_at, v.run_id, v.domain, 'vllm' AS engine, v.drafter, v.k,
       CASE WHEN v.passed THEN 1 ELSE 0 END AS passed,
       CASE WHEN v.statistic IS NULL THEN 0 ELSE 1 END AS tested,
       v.p_value AS smallest_p, v.statistic, v.request_id,
       CASE WHEN o.passed THEN 1 WHEN NOT o.passed THEN 0 END AS own_passed,
       o.p_value AS own_smallest_p, o.k AS own_k,
       d.validation,
       CASE WHEN d.promotable THEN 1 WHEN NOT d.promotable THEN 0 END AS promotable,
       CASE WHEN d.enabled THEN 1 WHEN NOT d.enabled THEN 0 END AS enabled
FROM validations v
LEFT JOIN validations o ON o.run_id = v.run_id AND o.domain = v.domain AND o.check_name = 'sampling'
LEFT JOIN domain_configs d ON d.run_id = v.run_id AND d.domain = v.domain
WHERE v.check_name = 'engine_sampling'
ORDER BY v.created_at DESC, v.run_id, v.domain;
