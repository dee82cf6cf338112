-- 0029: the operators' view of held groups (the Django admin's page reads keyed_groups); the table says what it holds.

COMMENT ON TABLE keyed_groups IS
    'Ordered groups: the next number to register and, for a group of a name whose group_failure is hold, the hold '
    'since its head failed (resume: celery keyed resume-group; skip the head: celery keyed skip-group-head).';
