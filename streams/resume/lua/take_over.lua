-- Take a stream over from a writer whose lease lapsed (failover), atomically: exactly one
-- replica's SET succeeds. Only a stream whose writer lease is gone, whose rebuild spec
-- and events are there, and whose last event does not end it. A stream cancelled (a
-- DELETE elsewhere) whose writer is gone is not taken over: its keys are deleted.
-- KEYS: the writer lease, the events, the spec, the reader lease, the cancel mark;
-- ARGV: the token, the lease in ms.
if redis.call('exists', KEYS[1]) == 1 or redis.call('exists', KEYS[3]) == 0 then
  return 0
end
if redis.call('exists', KEYS[5]) == 1 then
  redis.call('del', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  return 0
end
local last = redis.call('xrevrange', KEYS[2], '+', '-', 'COUNT', 1)
if #last == 0 then return 0 end
local fields = last[1][2]
for i = 1, #fields, 2 do
  if fields[i] == 'e' and fields[i + 1] == '1' then return 0 end
end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
