-- DELETE of a stream on a replica that does not generate it. Unknown (no events): 0.
-- Its writer alive: a cancel mark (PX the keys' time to live), which the writer finds
-- at its next renewal: it ends the stream and deletes its keys; 1. No writer (it died,
-- and nobody took the stream over): its keys are deleted now; 1.
-- KEYS: the writer lease, the events, the spec, the reader lease, the cancel mark;
-- ARGV: the mark's time to live in ms.
if redis.call('exists', KEYS[2]) == 0 then return 0 end
if redis.call('exists', KEYS[1]) == 0 then
  redis.call('del', KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  return 1
end
redis.call('set', KEYS[5], '1', 'PX', ARGV[1])
return 1
