-- Question: how much traffic arrived per domain and day, and how was its domain assigned?
-- Reads: traffic_requests. from_row: the log named the domain; by_rule: a keyword/regex rule
--   assigned it; fallback: no rule matched (the fallback domain). greedy: temperature 0.
-- Lengths are in tokens where the log carried token ids (NULL otherwise).
-- Production traffic only: rows the target generated for draft training (generated_by set)
--   are left out.
SELECT date(t.requested_at) AS day, t.domain,
       COUNT(*) AS requests,
       SUM(CASE WHEN t.domain_source = 'row' THEN 1 ELSE 0 END) AS from_row,
       SUM(CASE WHEN t.domain_source LIKE 'rule:%' THEN 1 ELSE 0 END) AS by_rule,
       SUM(CASE WHEN t.domain_source = 'fallback' THEN 1 ELSE 0 END) AS fallback,
       SUM(CASE WHEN t.temperature = 0 THEN 1 ELSE 0 END) AS greedy,
       AVG(t.prompt_tokens * 1.0) AS mean_prompt_tokens,
       AVG(t.response_tokens * 1.0) AS mean_response_tokens,
       SUM(CASE WHEN t.redactions > 0 THEN 1 ELSE 0 END) AS redacted
FROM traffic_requests t
WHERE t.generated_by IS NULL
GROUP BY date(t.requested_at), t.domain
ORDER BY 1, 2;
