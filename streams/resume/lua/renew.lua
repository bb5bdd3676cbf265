-- Compare-and-renew of a reader's lease (one round trip, atomic). A lease that is
-- another token's, or none (taken over by a reader that has left since, or lapsed), is
-- not renewed: its old holder stops. KEYS: the lease; ARGV: the token, the lease in ms.
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('pexpire', KEYS[1], ARGV[2])
else
  return 0
end
