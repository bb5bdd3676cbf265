-- Compare-and-delete of a lease: only the token's own. KEYS: the lease; ARGV: the token.
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
else
  return 0
end
