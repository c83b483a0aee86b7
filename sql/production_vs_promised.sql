-- Question: is production delivering the acceptance the champion promised, per domain and day?
-- Reads: monitor_scrapes (the serving deployments' spec-decode counter deltas, `specdec monitor
--   scrape`), monitor_promises (per deployment, config version and domain: the estimate's E and
--   its 95% interval at the deployed K, and the break-even E), request_spec_metrics with
--   traffic_requests (vLLM's per-request metrics of the imported traffic, by the day requested),
--   monitor_events (drift alerts and automatic rollbacks, by the day of their window's end).
-- Columns: day, deployment, config_version, domain, scrapes, drafts, accepted, scraped_e (1 +
--   accepted / drafts: the deployment's domains share its counters), requests, request_drafts,
--   request_e (the domain's own, from per-request metrics), promise_e, promise_lo, promise_hi,
--   break_even, verdict (below break-even | below promise | above promise | within promise |
--   no drafts), alerts, rollbacks, alert (the day's drift alert, in words), rollback (the day's
--   rollback or refused rollback, in words).
-- Empty until `specdec monitor scrape` has stored scrapes of a deployment of a registered version.
SELECT s.day, s.deployment, s.config_version, p.domain, s.scrapes, s.drafts, s.accepted,
       1.0 + s.accepted * 1.0 / NULLIF(s.drafts, 0) AS scraped_e,
       COALESCE(r.requests, 0) AS requests, r.drafts AS request_drafts,
       1.0 + r.accepted * 1.0 / NULLIF(r.drafts, 0) AS request_e,
       p.promise_e, p.promise_lo, p.promise_hi, p.break_even,
       CASE WHEN s.drafts = 0 THEN 'no drafts'
            WHEN p.break_even IS NOT NULL AND 1.0 + s.accepted * 1.0 / s.drafts < p.break_even
                THEN 'below break-even'
            WHEN p.promise_lo IS NOT NULL AND 1.0 + s.accepted * 1.0 / s.drafts < p.promise_lo
                THEN 'below promise'
            WHEN p.promise_hi IS NOT NULL AND 1.0 + s.accepted * 1.0 / s.drafts > p.promise_hi
                THEN 'above promise'
            ELSE 'within promise' END AS verdict,
       COALESCE(ev.alerts, 0) AS alerts, COALESCE(ev.rollbacks, 0) AS rollbacks,
       ev.alert, ev.rollback
FROM (
    SELECT date(scraped_at) AS day, deployment, config_name, config_version, COUNT(*) AS scrapes,
           SUM(delta_drafts) AS drafts, SUM(delta_accepted) AS accepted
    FROM monitor_scrapes
    WHERE config_version IS NOT NULL
    GROUP BY date(scraped_at), deployment, config_name, config_version
) s
JOIN monitor_promises p
  ON p.deployment = s.deployment AND p.config_name = s.config_name
 AND p.config_version = s.config_version
LEFT JOIN (
    SELECT date(t.requested_at) AS day, t.domain, COUNT(*) AS requests,
           SUM(m.spec_steps) AS drafts, SUM(m.accepted_tokens) AS accepted
    FROM request_spec_metrics m
    JOIN traffic_requests t ON t.id = m.request_id
    GROUP BY date(t.requested_at), t.domain
) r ON r.day = s.day AND r.domain = p.domain
LEFT JOIN (
    SELECT date(window_end) AS day, deployment, config_name, config_version,
           SUM(CASE WHEN kind = 'alert' THEN 1 ELSE 0 END) AS alerts,
           SUM(CASE WHEN kind = 'rollback' THEN 1 ELSE 0 END) AS rollbacks,
           MAX(CASE WHEN kind = 'alert' THEN reason END) AS alert,
           MAX(CASE WHEN kind IN ('rollback', 'rollback_refused') THEN reason END) AS rollback
    FROM monitor_events
    GROUP BY date(window_end), deployment, config_name, config_version
) ev ON ev.day = s.day AND ev.deployment = s.deployment AND ev.config_name = s.config_name
    AND ev.config_version = s.config_version
ORDER BY s.day, s.deployment, s.config_version, p.domain;
