-- Question: which champion was moved outside specdec's gates (MLflow's "Promote" button or alias pencil)?
-- Reads: promotions rows with action 'ungated', written by each registration that finds the
--   champion alias on a version that specdec did not last promote or roll back to.
-- A row means reviewers should re-promote with `specdec config promote N` (gates + audit row) or
--   roll back; reason says what specdec last did.
SELECT p.created_at AS noticed_at, p.config_name, p.config_version AS champion_version,
       p.run_id AS noticed_by_run, p.reason
FROM promotions p
WHERE p.action = 'ungated'
ORDER BY p.created_at DESC, p.id DESC;
