-- wrk script for scripts/bench/capacity.py: every wrk thread sends m.room.message
-- events into its own room, as its own user, one connection per thread. The
-- user/room pairs come from the file named by WRK_ROOMS ("<token> <room id>" lines;
-- thread N takes line N).
local next_id = 0

function setup(thread)
  next_id = next_id + 1
  thread:set("tid", next_id)
end

function init(args)
  local i = 0
  for line in io.lines(os.getenv("WRK_ROOMS")) do
    i = i + 1
    if i == tid then
      token, room = line:match("(%S+) (%S+)")
    end
  end
  assert(room, "no room for thread " .. tid)
  math.randomseed(os.time() + tid)
  prefix = "/_matrix/client/v3/rooms/" .. room .. "/send/m.room.message/wrk"
    .. tid .. "-" .. math.random(1, 1000000000) .. "-"
  headers = { ["Authorization"] = "Bearer " .. token, ["Content-Type"] = "application/json" }
  sent = 0
end

function request()
  sent = sent + 1
  return wrk.format("PUT", prefix .. sent, headers,
    '{"msgtype":"m.text","body":"capacity message ' .. sent .. '"}')
end
