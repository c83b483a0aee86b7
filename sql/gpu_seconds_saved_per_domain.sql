-- Question: how many GPU-seconds does the live (champion) config save per domain on the stored traffic?
-- Reads: traffic_requests (response tokens per target and domain; characters / 4 when a row has no
--   token ids), promotions + domain_configs (the champion's setting), live_measurements (plain
--   decode tokens per second for that run, domain, drafter and K).
-- Production traffic only: rows the target generated for draft training (generated_by set)
--   are left out.
-- Estimate: plain_decode_s = response tokens / plain tokens per second;
--   gpu_s_saved = plain_decode_s * (1 - 1 / speedup), speedup = measured, else predicted.
--   0 when the domain's speculation is off; NULL when no config or no measured rate exists.
WITH champion AS (
    SELECT p.target_id, p.run_id,
           ROW_NUMBER() OVER (PARTITION BY p.target_id ORDER BY p.created_at DESC, p.id DESC) AS rn
    FROM promotions p
    WHERE p.alias = 'champion' AND p.action IN ('promote', 'rollback')
),
live AS (
    SELECT ch.target_id, c.run_id, c.domain, CASE WHEN c.enabled THEN 1 ELSE 0 END AS enabled,
           c.drafter, c.k,
           COALESCE(c.measured_speedup, c.predicted_speedup) AS speedup
    FROM champion ch
    JOIN domain_configs c ON c.run_id = ch.run_id
    WHERE ch.rn = 1
),
rates AS (
    SELECT m.run_id, m.domain, m.drafter, m.k, AVG(m.plain_tokens_per_s) AS plain_tokens_per_s
    FROM live_measurements m
    WHERE m.plain_tokens_per_s > 0
    GROUP BY m.run_id, m.domain, m.drafter, m.k
),
traffic AS (
    SELECT t.model AS target_id, t.domain, COUNT(*) AS requests,
           SUM(COALESCE(t.response_tokens, t.response_chars / 4)) AS response_tokens
    FROM traffic_requests t
    WHERE t.generated_by IS NULL
    GROUP BY t.model, t.domain
)
SELECT tr.target_id, tr.domain, tr.requests, tr.response_tokens,
       l.enabled, l.drafter, l.k, l.speedup, r.plain_tokens_per_s,
       tr.response_tokens / r.plain_tokens_per_s AS plain_decode_s,
       CASE WHEN l.domain IS NULL THEN NULL
            WHEN l.enabled = 0 OR l.speedup IS NULL OR l.speedup <= 0 THEN 0.0
            WHEN r.plain_tokens_per_s IS NULL THEN NULL
            ELSE tr.response_tokens / r.plain_tokens_per_s * (1.0 - 1.0 / l.speedup) END
           AS gpu_s_saved
FROM traffic tr
LEFT JOIN live l ON l.target_id = tr.target_id AND l.domain = tr.domain
LEFT JOIN rates r ON r.run_id = l.run_id AND r.domain = l.domain AND r.drafter = l.drafter
                 AND r.k = l.k
ORDER BY tr.target_id, tr.domain;
