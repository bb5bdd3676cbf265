-- The same for a writer lease, never shortening it (Redis 7's GT): a renewal in flight
-- as the stream ends must not cut the longer life the ended stream's key was given.
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2], 'GT')
  return 1
else
  return 0
end
