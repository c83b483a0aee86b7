-- Question: which speculative decoding setting is live (the champion) for each domain of each target?
-- Reads: promotions (the latest champion promotion or rollback per target names the live run),
--   domain_configs (that run's per-domain settings), traffic_requests (domains seen in traffic).
-- Production traffic only: rows the target generated for draft training (generated_by set)
--   are left out.
-- enabled and forced are 1 / 0.
-- A domain that has traffic but no row in the champion's config runs without speculation
--   (the config's default is enabled = false); it is listed with status 'no config'.
WITH champion AS (
    SELECT p.target_id, p.run_id, p.config_version, p.created_at, p.actor, p.forced,
           ROW_NUMBER() OVER (PARTITION BY p.target_id ORDER BY p.created_at DESC, p.id DESC) AS rn
    FROM promotions p
    WHERE p.alias = 'champion' AND p.action IN ('promote', 'rollback')
),
live AS (
    SELECT ch.target_id, c.domain,
           CASE WHEN c.enabled THEN 1 ELSE 0 END AS enabled, c.drafter, c.k, c.max_batch_size,
           c.predicted_speedup, c.measured_speedup, c.samples, c.status,
           ch.run_id, ch.config_version, ch.created_at AS promoted_at, ch.actor AS promoted_by,
           CASE WHEN ch.forced THEN 1 ELSE 0 END AS forced
    FROM champion ch
    JOIN domain_configs c ON c.run_id = ch.run_id
    WHERE ch.rn = 1
),
seen AS (
    SELECT DISTINCT t.model AS target_id, t.domain
    FROM traffic_requests t
    WHERE t.generated_by IS NULL
)
SELECT target_id, domain, enabled, drafter, k, max_batch_size, predicted_speedup,
       measured_speedup, samples, status, run_id, config_version, promoted_at, promoted_by, forced
FROM live
UNION ALL
SELECT s.target_id, s.domain, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 'no config', NULL, NULL,
       NULL, NULL, NULL
FROM seen s
WHERE NOT EXISTS (SELECT 1 FROM live l WHERE l.target_id = s.target_id AND l.domain = s.domain)
ORDER BY 1, 2;
